"""optstate.save/load and the CLI on checkpoints written from Python; docs/hash.md re-implemented
independently here (Python xxhash) to check the C++ hash engine against its own specification."""
import json
import struct
from pathlib import Path

import pytest
import torch
import xxhash

import optstate


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _groups(model):
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]


def test_save_load_resume_is_bitwise(tmp_path):
    ref = _model()
    ropt = optstate.FusedAdamW(_groups(ref), lr=1e-2, amsgrad=True)
    _train(ref, ropt, 20)

    model = _model()
    opt = optstate.FusedAdamW(_groups(model), lr=1e-2, amsgrad=True)
    _train(model, opt, 10)
    optstate.save(tmp_path / "ckpt", model, opt)

    model2 = _model()  # fresh weights: everything must come from the checkpoint
    opt2 = optstate.FusedAdamW(_groups(model2), lr=0.5)
    optstate.load(tmp_path / "ckpt", model2, opt2)
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[1]["weight_decay"] == 0.0
    _train(model2, opt2, 10, start=10)
    for a, b in zip(ref.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(ref.parameters(), model2.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            assert torch.equal(ropt.state[a][k], opt2.state[b][k])


def _py_hash(ckpt: Path):
    """docs/hash.md, implemented from the document alone."""
    m = json.loads((ckpt / "manifest.json").read_text())
    groups = m["optimizer"]["param_groups"]

    def hx(v):
        return struct.pack(">d", float(v)).hex()

    def hyper(g):
        return (f"lr:{hx(g['lr'])},beta1:{hx(g['betas'][0])},beta2:{hx(g['betas'][1])},eps:{hx(g['eps'])},"
                f"weight_decay:{hx(g['weight_decay'])},amsgrad:{int(g['amsgrad'])},maximize:{int(g['maximize'])}")

    data = {f["path"]: (ckpt / f["path"]).read_bytes() for f in m["files"]}
    paths = [f["path"] for f in m["files"]]
    entries = {}
    for fqn, p in m["params"].items():
        for name, e in p["entries"].items():
            key = f"{fqn}.{name}"
            assert e["encoding"] == "dense"
            head = (f"optstate-entry-v1\nname={key}\nshape={','.join(map(str, p['shape']))}\nstep={p['step']}\n"
                    f"hyper={hyper(groups[p['group']])}\nencoding=dense,dtype={e['dtype']}\n\n").encode()
            size = {"f32": 4, "bf16": 2}[e["dtype"]]
            body = b"".join(data[paths[c["file"]]][c["offset"]:c["offset"] + (c["end"] - c["begin"]) * size]
                            for c in sorted(e["components"]["values"], key=lambda c: c["begin"]))
            entries[key] = xxhash.xxh3_128_hexdigest(head + body)
    root = "optstate-root-v1\nmode=raw\n" + f"kind={m['optimizer']['kind']}\n"
    for fqn in sorted(m["params"]):
        p = m["params"][fqn]
        root += (f"param {fqn} shape={','.join(map(str, p['shape']))} dtype={p['dtype']} step={p['step']} "
                 f"hyper={hyper(groups[p['group']])}\n")
    for key in sorted(entries):
        root += f"{entries[key]}  {key}\n"
    return xxhash.xxh3_128_hexdigest(root.encode()), entries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cli_hash_matches_the_documented_definition(tmp_path, optstate_cli, dtype):
    model = _model().to(dtype)
    opt = optstate.FusedAdamW(_groups(model), lr=1e-2)
    _train(model, opt, 1) if dtype == torch.float32 else None
    if dtype == torch.bfloat16:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    optstate.save(tmp_path / "c", model, opt)
    out = json.loads(optstate_cli("hash", "--json", tmp_path / "c").stdout)
    root, entries = _py_hash(tmp_path / "c")
    assert out["entries"] == entries
    assert out["root"] == root
    text = optstate_cli("hash", tmp_path / "c").stdout.splitlines()
    assert text[-1] == f"{root}  (root)"
    assert [line.split("  ")[1] for line in text[:-1]] == sorted(entries)


def test_inspect_reports_the_saved_state(tmp_path, optstate_cli):
    model = _model()
    opt = optstate.FusedAdamW(_groups(model), lr=2e-3)
    _train(model, opt, 4)
    optstate.save(tmp_path / "c", model, opt)
    j = json.loads(optstate_cli("inspect", "--json", tmp_path / "c").stdout)
    assert j["optimizer"] == "adamw"
    assert j["params"]["0.weight"]["shape"] == [32, 16]
    assert j["params"]["0.weight"]["step"] == 4
    assert j["param_groups"][0]["lr"] == 2e-3
    exp_avg = opt.state[model[0].weight]["exp_avg"]
    stats = j["params"]["0.weight"]["entries"]["exp_avg"]["stats"]
    assert stats["min"] == pytest.approx(exp_avg.min().item())
    assert stats["max"] == pytest.approx(exp_avg.max().item())
    assert j["totals"]["state_bytes_per_param"] == 8.0


def test_save_refuses_to_clobber_and_load_rejects_mismatch(tmp_path):
    model = _model()
    opt = optstate.FusedAdamW(model.parameters())
    _train(model, opt, 1)
    optstate.save(tmp_path / "c", model, opt)
    with pytest.raises(RuntimeError, match="already exists"):
        optstate.save(tmp_path / "c", model, opt, overwrite=False)
    other = torch.nn.Sequential(torch.nn.Linear(16, 33))
    with pytest.raises((KeyError, ValueError)):
        optstate.load(tmp_path / "c", other, optstate.FusedAdamW(other.parameters()))
    with pytest.raises(RuntimeError, match="no such file"):
        optstate.load(tmp_path / "missing", model, opt)
    # overwrite (the default) replaces a checkpoint, never a directory of other files: a save to a
    # wrong path such as the run directory must not delete it.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.log").write_text("keep")
    with pytest.raises(RuntimeError, match="run: exists and is not a checkpoint"):
        optstate.save(tmp_path / "run", model, opt)
    assert (tmp_path / "run" / "train.log").read_text() == "keep"
    optstate.save(tmp_path / "c", model, opt)  # a checkpoint is replaced


def _snapshot(model, opt):
    weights = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    return weights, state


def _unchanged(model, opt, snap):
    weights, state = snap
    if not all(torch.equal(a, b) for a, b in zip(model.parameters(), weights)):
        return False
    return all(opt.state[p].keys() == state[id(p)].keys() and
               all(torch.equal(opt.state[p][k], v) for k, v in state[id(p)].items()) for p in model.parameters())


def _corrupt_last_chunk(ckpt):
    """Flips one byte of the chunk a load reads last (the last param by name, its last entry), so a
    load that writes in place as it goes has changed everything else by then."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    fqn = sorted(manifest["params"])[-1]
    entries = manifest["params"][fqn]["entries"]
    entry = entries[sorted(entries)[-1]]
    chunk = list(entry["components"].values())[-1][-1]
    data = ckpt / manifest["files"][chunk["file"]]["path"]
    raw = bytearray(data.read_bytes())
    raw[chunk["offset"]] ^= 0x40
    data.write_bytes(bytes(raw))
    return fqn


@pytest.mark.parametrize("make", [lambda ps: optstate.FusedAdamW(ps, lr=1e-2),
                                  lambda ps: optstate.AdamW8bit(ps, lr=1e-2, min_8bit_size=256, block_size=64)],
                         ids=["FusedAdamW", "AdamW8bit"])
def test_failed_load_leaves_model_and_optimizer_unchanged(tmp_path, make):
    model = _model()
    opt = make(model.parameters())
    _train(model, opt, 3)
    optstate.save(tmp_path / "c", model, opt)
    fqn = _corrupt_last_chunk(tmp_path / "c")
    _train(model, opt, 2, start=3)  # live state now differs from the checkpoint everywhere
    snap = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match=rf"(?s)c/data/rank-00000.bin.*{fqn}|{fqn}.*c/data/rank-00000.bin"):
        optstate.load(tmp_path / "c", model, opt)
    assert _unchanged(model, opt, snap)
    # The same load read once (transactional=False) has overwritten the live tensors read before the
    # corrupt chunk: what the default guards against.
    with pytest.raises(RuntimeError, match="rank-00000.bin"):
        optstate.load(tmp_path / "c", model, opt, transactional=False)
    assert not _unchanged(model, opt, snap)


def test_load_of_another_models_checkpoint_changes_nothing(tmp_path):
    small = _model()
    sopt = optstate.FusedAdamW(small.parameters())
    _train(small, sopt, 1)
    optstate.save(tmp_path / "c", small, sopt)
    big = torch.nn.Sequential(*_model(), torch.nn.Linear(4, 4))  # the checkpoint's params, and '3.weight'
    bopt = optstate.FusedAdamW(big.parameters())
    _train(big, bopt, 2)
    snap = _snapshot(big, bopt)
    with pytest.raises(KeyError, match="has no param '3.weight'"):
        optstate.load(tmp_path / "c", big, bopt)
    assert _unchanged(big, bopt, snap)


@pytest.mark.parametrize("make", [optstate.FusedAdamW, lambda ps: optstate.AdamW8bit(ps, min_8bit_size=256)])
def test_wrapped_models_use_torchs_names_and_resume_from_their_dcp(tmp_path, optstate_cli, make):
    """torch.compile (per block, as torchtitan does), activation checkpointing, FSDP1 and DDP insert
    segments into named_parameters() ('0._orig_mod._checkpoint_wrapped_module.weight'); torch's
    state dicts, and so DCP, drop them ('0.weight'). optstate names params the same way: a wrapped
    and a plain model trained alike save the same checkpoint, and a DCP of the wrapped model loads
    into it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def build(wrap):
        model = _model()
        if wrap:
            model.register_module("0", torch.compile(checkpoint_wrapper(model[0]), backend="eager"))
        return model

    plain, wrapped = build(False), build(True)
    assert next(iter(wrapped.named_parameters()))[0] == "0._orig_mod._checkpoint_wrapped_module.weight"
    popt, wopt = make(plain.parameters()), make(wrapped.parameters())
    _train(plain, popt, 3)
    _train(wrapped, wopt, 3)
    optstate.save(tmp_path / "plain", plain, popt)
    optstate.save(tmp_path / "wrapped", wrapped, wopt)
    hashes = [json.loads(optstate_cli("hash", tmp_path / n, "--json").stdout) for n in ("plain", "wrapped")]
    assert hashes[0] == hashes[1] and "0.weight.exp_avg" in hashes[0]["entries"]
    msd, osd = get_state_dict(wrapped, wopt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    again = build(True)
    aopt = make(again.parameters())
    optstate.load(tmp_path / "dcp", again, aopt)
    assert optstate.verify(tmp_path / "wrapped", again, aopt) == []
    clash = torch.nn.Sequential(torch.nn.Linear(4, 4))  # '0.weight', and '_orig_mod.0.weight' below
    clash.register_module("_orig_mod", torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="'0.weight' and '_orig_mod.0.weight' both have the name '0.weight'"):
        optstate.save(tmp_path / "clash", clash, optstate.FusedAdamW(clash.parameters()))
    assert not (tmp_path / "clash").exists()


def test_collector_paused_only_while_saving_loading_and_reading(tmp_path, monkeypatch):
    """save, load, verify and read_state_dict run with Python's cyclic collector off (optstate/_gc.py)
    and leave it as they found it: on again after returning or raising, still off where the caller
    had turned it off."""
    import gc

    model = _model()
    opt = optstate.FusedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    seen = []
    real_params = optstate.checkpoint._params

    def watching(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_params(*args, **kwargs)

    monkeypatch.setattr(optstate.checkpoint, "_params", watching)
    assert gc.isenabled()
    calls = [lambda: optstate.save(tmp_path / "ck", model, opt), lambda: optstate.load(tmp_path / "ck", model, opt),
             lambda: optstate.verify(tmp_path / "ck", model, opt), lambda: optstate.read_state_dict(tmp_path / "ck")]
    for call in calls:
        call()
        assert gc.isenabled()
    assert seen and not any(seen)
    with pytest.raises(RuntimeError):
        optstate.load(tmp_path / "missing", model, opt)
    assert gc.isenabled()
    gc.disable()
    try:
        for call in calls:
            call()
            assert not gc.isenabled()
    finally:
        gc.enable()
