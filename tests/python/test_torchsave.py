"""The torch.save driver against real files: optimizer state_dicts that torch.optim.AdamW, torchao's
AdamW8bit and optstate's optimizers write with torch.save (Hugging Face's `optimizer.pt`, a plain
loop's `{"model": ..., "optimizer": ...}`), read by optstate with no Python in the loop, and what
optstate writes, loaded back by torch.load + optimizer.load_state_dict."""
import json
import math
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import forkserver
from conftest import REPO
from test_formats import assert_converts_to_ref, hashes, run_err, run_script

# Trains a small model with one optimizer, then saves the same state three ways: a DCP of
# get_state_dict (the reference reader path), torch.save of the optimizer's state_dict alone, and
# torch.save of {"model", "optimizer", "epoch"}; plus what torch/torchao hold, as plain tensors.
MAKE_PT = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    kind, named, out = sys.argv[1], sys.argv[2] == "named", sys.argv[3]
    # one thread: the GEMMs round alike in every process whatever the load (a resumed run is compared
    # bit for bit with one trained in another process)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 3))
    params = model.named_parameters() if named else model.parameters()
    if kind == "ao":
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(params, lr=1e-3, block_size=64)
    elif kind == "aofp8":  # torchao's AdamWFp8: float8_e4m3fn codes, read as fp32 values
        from torchao.optim import AdamWFp8
        opt = AdamWFp8(params, lr=1e-3)
    elif kind == "ao4":  # torchao's AdamW4bit: two codes a byte, a 16-entry map, read as fp32 values
        from torchao.optim import AdamW4bit
        opt = AdamW4bit(params, lr=1e-3)
    elif kind == "ours8":
        import optstate
        opt = optstate.AdamW8bit(params, lr=1e-3, block_size=64)
    elif kind == "bnb":  # bitsandbytes' AdamW8bit (Hugging Face's optim="adamw_bnb_8bit"): blocks of 256
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(params, lr=1e-3, weight_decay=0.05)
    elif kind == "groups":  # Hugging Face's layout: weights decayed, biases not, in two groups
        params = list(params)
        decay = [p for p in params if (p[1] if named else p).dim() > 1]
        rest = [p for p in params if (p[1] if named else p).dim() <= 1]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0,
                                 "lr": 2e-3}], lr=1e-3)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05, amsgrad=(kind == "ams"))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 64, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save(opt.state_dict(), out + ".optimizer.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, out + ".full.pt")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out + ".dcp")
    torch.save(osd, out + ".fqn.pt")  # keyed by fqn, as get_optimizer_state_dict / FSDP.optim_state_dict give it
    ref = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        st = opt.state[p]
        key = name if named else str(i)
        if kind == "bnb":  # bitsandbytes' own dequantization of its 8-bit state1/state2
            import bitsandbytes.functional as F
            for k, n in (("exp_avg", "1"), ("exp_avg_sq", "2")):
                s = st["state" + n]
                ref[key + "." + k] = s.clone() if s.dtype != torch.uint8 else F.dequantize_blockwise(
                    s, absmax=st["absmax" + n], code=st["qmap" + n], blocksize=256)
            continue
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k in st:
                v = st[k]
                ref[key + "." + k] = v.dequantize() if hasattr(v, "dequantize") else v.detach().clone()
            elif k + "_codes" in st:
                import optstate
                qmap = "dynamic-signed" if k == "exp_avg" else "dynamic-unsigned"
                ref[key + "." + k] = optstate.ops.dequantize_blockwise(
                    st[k + "_codes"], st[k + "_absmax"], 64, qmap).reshape(p.shape)
    torch.save(ref, out + ".optimizer.pt.ref.pt")
""")


def make_pt(tmp_path, kind, named):
    out = tmp_path / f"{kind}_{named}"
    run_script(tmp_path, MAKE_PT, "make_pt.py", kind, named, out)
    return out


def run_python(source):
    proc = forkserver.run([sys.executable, "-c", textwrap.dedent(source)], timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("kind", ["fp32", "ams", "groups", "ao", "ours8", "bnb", "aofp8", "ao4"])
def test_torch_saved_optimizer_reads_as_the_state_its_dcp_holds(tmp_path, optstate_cli, kind):
    out = make_pt(tmp_path, kind, "named")
    pt, full, ck = (f"{out}.optimizer.pt", f"{out}.full.pt", f"{out}.dcp")
    # param_names give the canonical names; the file with the model carries its weights too, so it
    # hashes like the DCP of the same model and optimizer, raw (8-bit codes as codes) and by value.
    assert hashes(optstate_cli, full) == hashes(optstate_cli, ck)
    assert hashes(optstate_cli, full, values=True) == hashes(optstate_cli, ck, values=True)
    alone, with_model = hashes(optstate_cli, pt)["entries"], hashes(optstate_cli, ck)["entries"]
    assert alone == {k: v for k, v in with_model.items() if not k.endswith(".param")}
    # The same optimizer state keyed by name (get_optimizer_state_dict) is the same state.
    assert hashes(optstate_cli, f"{out}.fqn.pt") == hashes(optstate_cli, pt)
    # What torch / torchao hold (torchao's own dequantize for its 8-bit moments), bit for bit.
    assert_converts_to_ref(optstate_cli, pt, tmp_path / "pt.safetensors", "--to", "fp32")
    insp = json.loads(optstate_cli("inspect", full, "--json").stdout)
    assert len(insp["param_groups"]) == (2 if kind == "groups" else 1)
    assert insp["format"] == ("bitsandbytes" if kind == "bnb" else "torchao" if kind.startswith("ao") else "torchsave")
    assert insp["optimizer"] == ("adamw8bit" if kind in ("ao", "ours8", "bnb") else "adamw")
    assert "['epoch']" in insp["not_read"]
    assert optstate_cli("validate", pt).returncode == 0


def test_unnamed_params_are_numbered_as_torch_numbers_them(tmp_path, optstate_cli):
    out = make_pt(tmp_path, "ao", "unnamed")
    pt = f"{out}.optimizer.pt"
    names = sorted(hashes(optstate_cli, pt)["entries"])
    assert names == ["0.exp_avg", "0.exp_avg_sq", "1.exp_avg", "1.exp_avg_sq", "2.exp_avg", "2.exp_avg_sq",
                     "3.exp_avg", "3.exp_avg_sq"]
    assert_converts_to_ref(optstate_cli, pt, tmp_path / "pt.safetensors", "--to", "fp32")


@pytest.mark.parametrize("named", ["named", "unnamed"])
def test_written_optimizer_pt_loads_into_torch_adamw_and_training_continues_bitwise(tmp_path, optstate_cli, named):
    out = make_pt(tmp_path, "ams", named)
    pt = f"{out}.optimizer.pt"
    # Through optstate's own format and back: torch.load sees the very tensors and groups it saved.
    optstate_cli("convert", pt, tmp_path / "native")
    optstate_cli("convert", tmp_path / "native", tmp_path / "back.pt", "--format", "torchsave")
    assert hashes(optstate_cli, tmp_path / "back.pt") == hashes(optstate_cli, pt)
    # the full checkpoint (weights + optimizer) round-trips too
    optstate_cli("convert", f"{out}.full.pt", tmp_path / "full_native")
    optstate_cli("convert", tmp_path / "full_native", tmp_path / "full_back.pt", "--format", "torchsave")
    not_read = json.loads(optstate_cli("inspect", f"{out}.full.pt", "--json").stdout)["not_read"]
    # unnamed: the numbered params are named after the model beside them, so its weights are carried too
    assert not_read == ["['epoch']"]
    if named == "unnamed":
        assert sorted(hashes(optstate_cli, f"{out}.full.pt")["entries"]) == sorted(
            f"{n}.{e}" for n in ("0.weight", "0.bias", "2.weight", "2.bias")
            for e in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "param"))
    run_python(f"""
        import torch
        torch.set_num_threads(1)  # as MAKE_PT trained: its steps are compared bit for bit
        a, b = torch.load({pt!r}, weights_only=True), torch.load({str(tmp_path / "back.pt")!r}, weights_only=True)
        assert a["param_groups"] == b["param_groups"], (a["param_groups"], b["param_groups"])
        assert a["state"].keys() == b["state"].keys()
        for i in a["state"]:
            assert a["state"][i].keys() == b["state"][i].keys()
            for k, v in a["state"][i].items():
                assert v.dtype == b["state"][i][k].dtype and torch.equal(v, b["state"][i][k]), (i, k)
        def run(sd=None, steps=3):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 3))
            o = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05, amsgrad=True)
            if sd is not None:
                m.load_state_dict(sd["model"])
                o.load_state_dict(sd["optimizer"])
            for step in range(3 - steps, 3 + 2):
                if step < 0:
                    continue
                g = torch.Generator().manual_seed(step)
                m(torch.randn(8, 64, generator=g)).square().sum().backward()
                o.step()
                o.zero_grad()
            return m
        whole = run()
        resumed = run(torch.load({str(tmp_path / "full_back.pt")!r}, weights_only=True), steps=0)
        assert all(torch.equal(x, y) for x, y in zip(whole.parameters(), resumed.parameters()))
        print("ok")
    """)


def test_torchao_8bit_optimizer_pt_converts_to_plain_adamw_state_without_torchao(tmp_path, optstate_cli):
    out = make_pt(tmp_path, "ao", "named")
    optstate_cli("convert", f"{out}.full.pt", tmp_path / "plain.pt", "--format", "torchsave")
    ref = torch.load(f"{out}.optimizer.pt.ref.pt")
    # A process that never imports torchao loads it into torch.optim.AdamW: exp_avg and exp_avg_sq
    # are torchao's own dequantize of its codes, bit for bit.
    run_python(f"""
        import sys, torch
        sd = torch.load({str(tmp_path / "plain.pt")!r}, weights_only=True)
        ref = torch.load({f"{out}.optimizer.pt.ref.pt"!r})
        m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 3))
        m.load_state_dict(sd["model"])
        o = torch.optim.AdamW(m.parameters())
        o.load_state_dict(sd["optimizer"])
        names = dict(zip(m.parameters(), (n for n, _ in m.named_parameters())))
        for p, st in o.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[k], ref[names[p] + "." + k].float()), (names[p], k)
            assert st["step"].item() == 3
        assert abs(o.param_groups[0]["lr"] - 1e-3) < 1e-9
        assert "torchao" not in sys.modules
        print("ok")
    """)
    assert len(ref) == 8


def test_a_data_pkl_over_64_mib_reads(tmp_path, optstate_cli):
    """data.pkl was capped at 64 MiB, which refused torch's own optimizer.pt past ~290,000 params
    (torch pickles ~230 bytes a param); the cap is 1 GiB now, as for a DCP .metadata. A group key
    holding a 65 MiB string makes such a data.pkl in a second."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["note"] = "x" * (65 << 20)
    path = tmp_path / "optimizer.pt"
    torch.save(sd, path)
    with zipfile.ZipFile(path) as z:
        pkl = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
        assert pkl.file_size > 64 << 20
    out = optstate_cli("validate", path).stdout
    assert "ok:" in out and "4 entries" in out, out
    assert optstate_cli("hash", path).returncode == 0


def test_damaged_or_foreign_torch_save_files_are_refused_by_name(tmp_path, optstate_cli):
    out = make_pt(tmp_path, "fp32", "named")
    pt = f"{out}.optimizer.pt"
    data = open(pt, "rb").read()

    def refused(path, *needles, code=2, cmd="inspect"):
        proc = optstate_cli(cmd, path, check=False)
        assert proc.returncode == code, (proc.returncode, proc.stderr)
        said = proc.stderr + proc.stdout  # validate reports findings on stdout
        for n in needles:
            assert n in said, (n, said)
        return said

    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    refused(tmp_path / "cut.pt", "cut.pt")
    # One bit of a moment flipped: the storage's CRC-32 no longer matches; validate names the tensor.
    with zipfile.ZipFile(pt) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/1"))
        at = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 100
    flipped = bytearray(data)
    flipped[at] ^= 0x10
    (tmp_path / "flip.pt").write_bytes(bytes(flipped))
    refused(tmp_path / "flip.pt", "flip.pt", "CRC-32", "'0.weight.exp_avg'", cmd="validate", code=1)
    # The lowest bit of lr in data.pkl: the record's CRC-32 catches what no tensor checksum covers.
    import struct
    lr_at = data.index(b"G" + struct.pack(">d", 1e-3))
    flipped = bytearray(data)
    flipped[lr_at + 8] ^= 0x01
    (tmp_path / "lr.pt").write_bytes(bytes(flipped))
    refused(tmp_path / "lr.pt", "lr.pt", "CRC-32 of record", "data.pkl")
    # A model's state_dict is no optimizer state; nor is a list of tensors.
    torch.save(torch.nn.Linear(4, 4).state_dict(), tmp_path / "model.pt")
    refused(tmp_path / "model.pt", "model.pt", "no optimizer state_dict")
    torch.save([torch.zeros(3)], tmp_path / "list.pt")
    refused(tmp_path / "list.pt", "list.pt", "not a dict")
    # Two optimizers in one file: which one is meant is not guessed.
    sd = torch.load(pt)
    torch.save({"opt_a": sd, "opt_b": sd}, tmp_path / "two.pt")
    refused(tmp_path / "two.pt", "two.pt", "2 optimizer state_dicts")
    # ... nor in Lightning's list of them (a GAN's generator and discriminator optimizers).
    torch.save({"state_dict": {}, "optimizer_states": [sd, sd]}, tmp_path / "gan.ckpt")
    refused(tmp_path / "gan.ckpt", "gan.ckpt", "holds 2 optimizer state_dicts (['optimizer_states'][0], "
            "['optimizer_states'][1])")
    # State for a param id no group lists.
    bad = torch.load(pt)
    bad["state"][7] = bad["state"][0]
    torch.save(bad, tmp_path / "stray.pt")
    refused(tmp_path / "stray.pt", "stray.pt", "param id 7")
    # Moments of different shapes for one param.
    bad = torch.load(pt)
    bad["state"][0]["exp_avg_sq"] = torch.zeros(5)
    torch.save(bad, tmp_path / "shapes.pt")
    refused(tmp_path / "shapes.pt", "shapes.pt", "'0.weight'", "exp_avg")
    # SGD's state is not AdamW's.
    m = torch.nn.Linear(4, 4)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 4)).sum().backward()
    sgd.step()
    torch.save(sgd.state_dict(), tmp_path / "sgd.pt")
    refused(tmp_path / "sgd.pt", "sgd.pt", "param group 0: 'dampening' is torch.optim.SGD's group: not AdamW's")
    # Hugging Face's checkpoint folder is no checkpoint itself; the error names the file that is.
    hf = tmp_path / "checkpoint-500"
    hf.mkdir()
    (hf / "optimizer.pt").write_bytes(data)
    (hf / "trainer_state.json").write_text("{}")
    torch.save(torch.nn.Linear(4, 4).state_dict(), hf / "pytorch_model.bin")  # a zip too, but no optimizer
    refused(hf, "checkpoint-500: not a checkpoint in any known format", "it holds optimizer.pt (torchsave): pass that file")
    # A param name that is not text (a lone surrogate pickles as bytes that are not UTF-8): refused by
    # name, by every command; an entry the file carries may have such a key: shown, not a failure.
    bad = torch.load(pt)
    bad["param_groups"][0]["param_names"][0] = "w\udcff.weight"
    torch.save(bad, tmp_path / "surrogate.pt")
    for cmd in ("inspect", "hash"):
        refused(tmp_path / "surrogate.pt", "surrogate.pt: param name 'w\\xed\\xb3\\xbf.weight' is not valid UTF-8",
                cmd=cmd)
    refused(tmp_path / "surrogate.pt", "not valid UTF-8", cmd="validate", code=1)
    # ... nor one holding a line break: `hash` prints a name per line, and this one would forge the root.
    bad["param_groups"][0]["param_names"][0] = "w\n" + "0" * 32 + "  (root)"
    torch.save(bad, tmp_path / "newline.pt")
    refused(tmp_path / "newline.pt", "newline.pt: param name 'w\\x0a" + "0" * 32 + "  (root)' holds a control character",
            cmd="hash")
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "cfg\udcff": 1}, tmp_path / "carried.pt")
    shown = json.loads(optstate_cli("inspect", "--json", tmp_path / "carried.pt").stdout)
    assert "cfg\ufffd" in json.dumps(shown, ensure_ascii=False), shown
    # A failed convert leaves nothing behind.
    proc = optstate_cli("convert", tmp_path / "flip.pt", tmp_path / "never.pt", "--format", "torchsave", check=False)
    assert proc.returncode != 0 and not (tmp_path / "never.pt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".never")] == []


def test_optstate_load_takes_a_torch_saved_model_and_optimizer(tmp_path, optstate_cli):
    out = make_pt(tmp_path, "fp32", "named")
    unnamed = make_pt(tmp_path, "fp32", "unnamed")
    run_python(f"""
        import torch, optstate
        sd = torch.load({f"{out}.full.pt"!r}, weights_only=True)
        m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 3))
        o = optstate.FusedAdamW(m.parameters(), lr=0.5)
        optstate.load({f"{out}.full.pt"!r}, m, o)
        assert optstate.verify({f"{out}.full.pt"!r}, m, o) == []
        for i, (name, p) in enumerate(m.named_parameters()):
            assert torch.equal(p, sd["model"][name])
            st, ref = o.state[p], sd["optimizer"]["state"][i]
            assert torch.equal(st["exp_avg"], ref["exp_avg"]) and torch.equal(st["exp_avg_sq"], ref["exp_avg_sq"])
            assert st["step"].item() == ref["step"].item() == 3
        assert o.param_groups[0]["lr"] == 1e-3 and o.param_groups[0]["weight_decay"] == 0.05
        # Numbered params beside the model that names them (one placement fits): loaded by name.
        m2 = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 3))
        o2 = optstate.FusedAdamW(m2.parameters(), lr=0.5)
        optstate.load({f"{unnamed}.full.pt"!r}, m2, o2)
        nsd = torch.load({f"{unnamed}.full.pt"!r}, weights_only=True)
        for i, (name, p) in enumerate(m2.named_parameters()):
            assert torch.equal(p, nsd["model"][name])
            assert torch.equal(o2.state[p]["exp_avg_sq"], nsd["optimizer"]["state"][i]["exp_avg_sq"])
        # Numbered params alone (no param_names, no model) are not matched to names by guesswork.
        try:
            optstate.load({f"{unnamed}.optimizer.pt"!r}, m, o)
            raise AssertionError("loaded numbered params by name")
        except KeyError as e:
            assert "numbered" in str(e) and "'0.weight'" in str(e), e
        print("ok")
    """)


def test_params_the_optimizer_never_stepped_are_carried_by_their_weights(tmp_path, optstate_cli):
    # Only the first layer gets gradients: torch keeps no state for the second.
    run_python(f"""
        import torch
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        o = torch.optim.AdamW(m.named_parameters())
        m[0](torch.randn(2, 8)).sum().backward()
        o.step()
        torch.save({{"model": m.state_dict(), "optimizer": o.state_dict()}}, {str(tmp_path / "full.pt")!r})
        torch.save(o.state_dict(), {str(tmp_path / "opt.pt")!r})
        print("ok")
    """)
    full = json.loads(optstate_cli("inspect", tmp_path / "full.pt", "--json").stdout)
    assert sorted(full["params"]) == ["0.bias", "0.weight", "1.bias", "1.weight"] and full["not_read"] == []
    alone = json.loads(optstate_cli("inspect", tmp_path / "opt.pt", "--json").stdout)
    assert sorted(alone["params"]) == ["0.bias", "0.weight"]
    assert alone["not_read"] == ["2 params without state or weights (never stepped: no shape in the file)"]
    # through native and back: the same state, and torch's load_state_dict takes it (all 4 params listed)
    optstate_cli("convert", tmp_path / "full.pt", tmp_path / "native")
    optstate_cli("convert", tmp_path / "native", tmp_path / "back.pt")
    assert hashes(optstate_cli, tmp_path / "back.pt") == hashes(optstate_cli, tmp_path / "full.pt")
    run_python(f"""
        import torch
        sd = torch.load({str(tmp_path / "back.pt")!r}, weights_only=True)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        m.load_state_dict(sd["model"])
        o = torch.optim.AdamW(m.parameters())
        o.load_state_dict(sd["optimizer"])
        assert sorted(sd["optimizer"]["state"]) == [0, 1] and len(o.param_groups[0]["params"]) == 4
        print("ok")
    """)


def jit_archive(path):
    """A LibTorch optimizer archive as LibTorch itself loads it (torch.jit.load), independently of
    optstate: per param in group order, (group options, step, {name: tensor}) or (options, None, {})."""
    m = torch.jit.load(str(path))
    pg, out = m.param_groups, []
    for gi in range(int(getattr(pg, "param_groups/size"))):
        g = getattr(pg, f"param_groups/{gi}")
        o = g.options
        options = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, amsgrad=o.amsgrad)
        for j in range(int(getattr(g, "params/size"))):
            key = getattr(g, f"params/{j}")
            if not m.state._c.hasattr(key):
                out.append((options, None, {}))
                continue
            st = getattr(m.state, key)
            moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
            names = moments + tuple(m + s for m in moments for s in ("_codes", "_absmax")) + ("block_size",)
            out.append((options, st.step, {n: st._c.getattr(n) for n in names if st._c.hasattr(n)}))
    return out


@pytest.mark.parametrize("name", ["libtorch_adamw", "libtorch_adamw8bit"])
def test_libtorch_optimizer_archive_converts_to_torch_adamw_state(tmp_path, optstate_cli, name):
    """C++'s torch::save(optimizer) of torch::optim::AdamW and of optstate's AdamW8bit
    (tests/optim/write_libtorch_archives.cpp): optstate reads it with no LibTorch and writes a
    torch.optim.AdamW state_dict holding what torch.jit.load sees in the archive (8-bit moments
    dequantized with torchao's maps), which torch.optim.AdamW loads and steps from."""
    from torchao.optim import quant_utils as qu
    src = REPO / "formats/libtorch/testdata" / f"{name}.pt"
    ref = jit_archive(src)
    assert [step for _, step, _ in ref] == [3, 3, None]  # the third param never had a gradient
    r = optstate_cli("inspect", src)
    assert "1 param without state or weights" in r.stdout
    optstate_cli("convert", src, tmp_path / "plain.pt")
    sd = torch.load(tmp_path / "plain.pt")
    assert [g["params"] for g in sd["param_groups"]] == [[0], [1]]
    maps = {True: torch.tensor(qu.create_dynamic_map(True)), False: torch.tensor(qu.create_dynamic_map(False))}
    for i, (options, step, tensors) in enumerate(ref[:2]):
        group = sd["param_groups"][0 if i == 0 else 1]
        assert {k: group[k] for k in options} == options
        st = sd["state"][i]
        assert float(st["step"]) == step
        for moment in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if moment in tensors:
                want = tensors[moment]
            elif moment + "_codes" in tensors:
                codes, absmax = tensors[moment + "_codes"], tensors[moment + "_absmax"]
                block = tensors["block_size"]
                qmap = maps[moment == "exp_avg"]
                want = (qmap[codes.long().flatten()].view(-1, block) * absmax.view(-1, 1)).view(codes.shape)
            else:
                assert moment not in st, moment
                continue
            assert torch.equal(st[moment], want), (i, moment)
    w, b = torch.zeros(64, 80, requires_grad=True), torch.zeros(80, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [w], "amsgrad": True}, {"params": [b]}])
    opt.load_state_dict(sd)
    (w.sum() + b.sum()).backward()
    opt.step()
    assert float(opt.state[w]["step"]) == 4 and opt.param_groups[1]["lr"] == 3e-2


def test_python_optimizer_state_converts_to_a_libtorch_archive_torch_jit_load_reads(tmp_path, optstate_cli):
    """torchao's AdamW8bit optimizer.pt (a Python run) as LibTorch's optimizer archive, for a C++
    loop's torch::load: PyTorch's own TorchScript loader reads it; 8-bit moments keep torchao's codes
    and scales (optstate's AdamW8bit layout), or with --to fp32 are torchao's own dequantize()."""
    src = REPO / "formats/torchsave/testdata/torchao_adamw8bit.pt"
    sd = torch.load(src, weights_only=False)
    r = optstate_cli("convert", src, tmp_path / "eight.pt", "--format", "libtorch")
    assert "numbers the params" not in r.stderr  # torch numbered them already
    optstate_cli("convert", src, tmp_path / "fp32.pt", "--format", "libtorch", "--to", "fp32")
    eight, fp32 = jit_archive(tmp_path / "eight.pt"), jit_archive(tmp_path / "fp32.pt")
    assert len(eight) == len(fp32) == len(sd["state"])
    for i, st in sd["state"].items():
        (options, step, tensors), (_, step32, dense) = eight[i], fp32[i]
        assert step == step32 == int(st["step"])
        assert options["lr"] == float(sd["param_groups"][0]["lr"])
        for m in ("exp_avg", "exp_avg_sq"):
            v = st[m]
            if hasattr(v, "codes"):  # torchao's OptimState8bit
                assert torch.equal(tensors[m + "_codes"], v.codes) and torch.equal(tensors[m + "_absmax"], v.scale)
                assert torch.equal(dense[m], v.dequantize())
            else:
                assert torch.equal(tensors[m], v) and torch.equal(dense[m], v)
    assert optstate_cli("hash", tmp_path / "eight.pt").stdout.splitlines()[-1] == \
        optstate_cli("hash", src).stdout.splitlines()[-1]


# bitsandbytes' AdamW8bit as Hugging Face's Trainer runs it (optim="adamw_bnb_8bit"): a weight of
# 7000 elements (8-bit, a partial last block of 256), small params in fp32 state, two groups.
MAKE_BNB = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp, bitsandbytes as bnb
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.GELU(), torch.nn.Linear(70, 3))
    named = list(model.named_parameters())
    opt = bnb.optim.AdamW8bit([{"params": [p for p in named if p[1].dim() > 1], "weight_decay": 0.05},
                               {"params": [p for p in named if p[1].dim() <= 1], "weight_decay": 0.0}], lr=1e-3)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 100, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save(opt.state_dict(), out + ".optimizer.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out + ".full.pt")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out + ".dcp")
""")


def bnb_ref(st, blocksize=256):
    """What bitsandbytes holds, by its own dequantization: {moment: fp32 tensor}."""
    import bitsandbytes.functional as F
    out = {}
    for k, n in (("exp_avg", "1"), ("exp_avg_sq", "2")):
        s = st["state" + n]
        out[k] = s if s.dtype != torch.uint8 else F.dequantize_blockwise(
            s, absmax=st["absmax" + n], code=st["qmap" + n], blocksize=blocksize)
    return out


def test_bitsandbytes_8bit_state_converts_to_plain_adamw_and_moves_into_optstate_exactly(tmp_path, optstate_cli):
    out = tmp_path / "bnb"
    run_script(tmp_path, MAKE_BNB, "make_bnb.py", out)
    pt, full, ck = f"{out}.optimizer.pt", f"{out}.full.pt", f"{out}.dcp"
    insp = json.loads(optstate_cli("inspect", pt, "--json").stdout)
    assert insp["optimizer"] == "adamw8bit" and insp["not_read"] == []
    assert [g["weight_decay"] for g in insp["param_groups"]] == [0.05, 0.0]
    # The DCP of the same optimizer (get_state_dict: the 8-bit tensors one level down) is the same state.
    assert hashes(optstate_cli, full) == hashes(optstate_cli, ck)
    assert hashes(optstate_cli, pt)["entries"].keys() == {
        f"{p}.{m}" for p in ("0.weight", "0.bias", "2.weight", "2.bias") for m in ("exp_avg", "exp_avg_sq")}
    # To torch.optim.AdamW's state_dict: every moment is bitsandbytes' own dequantization, bit for bit.
    optstate_cli("convert", pt, tmp_path / "plain.pt")
    sd, plain = torch.load(pt, weights_only=False), torch.load(tmp_path / "plain.pt", weights_only=True)
    for i, st in sd["state"].items():
        ref = bnb_ref(st["__bnb_optimizer_quant_state__"])
        for k, v in ref.items():
            assert torch.equal(plain["state"][i][k], v), (i, k)
        assert plain["state"][i]["step"].item() == st["step"] == 3
    assert [g["weight_decay"] for g in plain["param_groups"]] == [0.05, 0.0]
    # ... which torch.optim.AdamW takes and steps on.
    model = torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.GELU(), torch.nn.Linear(70, 3))
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() > 1]},
                             {"params": [p for p in model.parameters() if p.dim() <= 1]}])
    opt.load_state_dict(plain)
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    # The DCP becomes one torch.optim.AdamW resumes (get_state_dict + dcp.load + set_state_dict).
    optstate_cli("convert", ck, tmp_path / "plain.dcp", "--format", "dcp")
    assert hashes(optstate_cli, tmp_path / "plain.dcp", values=True) == hashes(optstate_cli, ck, values=True)
    run_python(f"""
        import torch, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        m = torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.GELU(), torch.nn.Linear(70, 3))
        o = torch.optim.AdamW([{{"params": [p for p in m.parameters() if p.dim() > 1]}},
                               {{"params": [p for p in m.parameters() if p.dim() <= 1]}}], lr=0.5)
        m(torch.randn(2, 100)).sum().backward()
        o.step()
        msd, osd = get_state_dict(m, o)
        sd = {{"model": msd, "optim": osd}}
        dcp.load(sd, checkpoint_id={str(tmp_path / "plain.dcp")!r})
        set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        ref = torch.load({pt!r}, weights_only=False)["state"][0]["__bnb_optimizer_quant_state__"]
        import bitsandbytes.functional as F
        want = F.dequantize_blockwise(ref["state1"], absmax=ref["absmax1"], code=ref["qmap1"], blocksize=256)
        assert torch.equal(o.state[m[0].weight]["exp_avg"], want)
        assert o.state[m[0].weight]["step"].item() == 3 and o.param_groups[0]["lr"] == 1e-3
        m(torch.randn(2, 100)).sum().backward()
        o.step()
        print("ok")
    """)
    # Into optstate's AdamW8bit with nothing requantized: its codes and scales are bitsandbytes'.
    run_python(f"""
        import torch, optstate
        sd = torch.load({full!r}, weights_only=False)
        m = torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.GELU(), torch.nn.Linear(70, 3))
        o = optstate.AdamW8bit([{{"params": [p for p in m.parameters() if p.dim() > 1]}},
                                {{"params": [p for p in m.parameters() if p.dim() <= 1]}}], lr=0.5, block_size=256)
        optstate.load({full!r}, m, o)
        ids = {{n: i for g in sd["optimizer"]["param_groups"] for n, i in zip(g["param_names"], g["params"])}}
        for name, p in m.named_parameters():
            st, ref = o.state[p], sd["optimizer"]["state"][ids[name]]["__bnb_optimizer_quant_state__"]
            assert torch.equal(p, sd["model"][name])
            if ref["state1"].dtype == torch.uint8:
                assert torch.equal(st["exp_avg_codes"], ref["state1"]) and torch.equal(st["exp_avg_absmax"], ref["absmax1"])
                assert torch.equal(st["exp_avg_sq_codes"], ref["state2"]) and torch.equal(st["exp_avg_sq_absmax"], ref["absmax2"])
            else:
                assert torch.equal(st["exp_avg"], ref["state1"]) and torch.equal(st["exp_avg_sq"], ref["state2"])
            assert st["step"].item() == 3
        print("ok")
    """)


def test_bitsandbytes_older_layout_and_foreign_state_are_read_or_refused_by_name(tmp_path, optstate_cli):
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    def trained(make, n=100):
        torch.manual_seed(0)
        model = torch.nn.Linear(n, 70)
        opt = make(model.parameters())
        for _ in range(2):
            model(torch.randn(4, n)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return opt.state_dict()

    def flat(sd):  # the layout of releases before the nested dict: tensors beside "step"
        return {"state": {i: {"step": st["step"], **st.get("__bnb_optimizer_quant_state__", {})}
                          for i, st in sd["state"].items()}, "param_groups": sd["param_groups"]}

    sd = flat(trained(lambda p: bnb.optim.AdamW8bit(p, lr=1e-3)))
    # Older releases quantized in blocks of 2048: the same moments, quantized so by bitsandbytes.
    w = sd["state"][0]
    for n in ("1", "2"):
        values = F.dequantize_blockwise(w["state" + n], absmax=w["absmax" + n], code=w["qmap" + n], blocksize=256)
        w["state" + n], qs = F.quantize_blockwise(values, code=w["qmap" + n], blocksize=2048)
        w["absmax" + n] = qs.absmax
    torch.save(sd, tmp_path / "b2048.pt")
    assert "8bit/2048 dynamic-signed" in optstate_cli("inspect", tmp_path / "b2048.pt").stdout
    optstate_cli("convert", tmp_path / "b2048.pt", tmp_path / "b2048_plain.pt")
    plain = torch.load(tmp_path / "b2048_plain.pt", weights_only=True)
    for k, v in bnb_ref(w, blocksize=2048).items():
        assert torch.equal(plain["state"][0][k], v), k

    def refused(name, state_dict, *words):
        torch.save(state_dict, tmp_path / name)
        err = run_err(optstate_cli, "inspect", tmp_path / name)
        assert str(tmp_path / name) in err and all(w in err for w in words), err

    # Not AdamW: Lion keeps one moment, AdEMAMix three betas and two moments in state1.
    refused("lion.pt", trained(lambda p: bnb.optim.Lion8bit(p, lr=1e-3)), "state[0]", "'state1' without 'state2'", "Lion")
    refused("ademamix.pt", trained(lambda p: bnb.optim.AdEMAMix8bit(p, lr=1e-3)), "param group 0", "AdEMAMix")
    # The same in a DCP (get_state_dict + dcp.save), whose reader shares the rules.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    for name, make, words in (("lion", bnb.optim.Lion8bit, ["param 'weight'", "'state1' without 'state2'"]),
                              ("ademamix", bnb.optim.AdEMAMix8bit, ["param group 0", "AdEMAMix"])):
        torch.manual_seed(0)
        model = torch.nn.Linear(100, 70)
        opt = make(model.parameters(), lr=1e-3)
        model(torch.randn(4, 100)).square().sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / f"{name}.dcp"))
        err = run_err(optstate_cli, "inspect", tmp_path / f"{name}.dcp")
        assert all(w in err for w in words), err
    # Damaged or unsupported 8-bit parts, named with the param and the field.
    def edited(edit):
        s = flat(trained(lambda p: bnb.optim.AdamW8bit(p, lr=1e-3)))
        edit(s["state"][0])
        return s
    refused("nonblockwise.pt", edited(lambda st: st.update(max1=st.pop("absmax1"), new_max1=torch.ones(1))),
            "state[0]", "'state1'", "block_wise=False")
    refused("noqmap.pt", edited(lambda st: st.pop("qmap2")), "'state2'", "qmap2")
    refused("miscounted.pt", edited(lambda st: st.update(absmax1=st["absmax1"][:-1])), "'state1'", "27 scales for 7000 codes")
    refused("custom_map.pt", edited(lambda st: st.update(qmap1=st["qmap1"] * 0.5)),
            "quantization map is neither")
    refused("orphan.pt", edited(lambda st: st.pop("state2")), "without 'state2'")
    # A block that never saw a gradient keeps bitsandbytes' scale 0 (it does not clamp): a block of
    # zeros, which validates clean and reads as zeros.
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 70)
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    model.weight.grad = torch.zeros_like(model.weight)
    model.weight.grad[:3] = torch.randn(3, 100)
    model.bias.grad = torch.zeros_like(model.bias)
    opt.step()
    assert int((opt.state[model.weight]["absmax1"] == 0).sum()) > 0
    torch.save(opt.state_dict(), tmp_path / "zero_blocks.pt")
    assert optstate_cli("validate", tmp_path / "zero_blocks.pt").returncode == 0
    optstate_cli("convert", tmp_path / "zero_blocks.pt", tmp_path / "zero_blocks_plain.pt")
    plain = torch.load(tmp_path / "zero_blocks_plain.pt", weights_only=True)
    assert torch.equal(plain["state"][0]["exp_avg"], bnb_ref(flat(opt.state_dict())["state"][0])["exp_avg"])
    assert torch.equal(plain["state"][0]["exp_avg"].flatten()[512:], torch.zeros(70 * 100 - 512))  # blocks 2..
    # Older releases' clipping history (percentile_clipping < 100: "gnorm_vec", 100 norms) has no
    # canonical place: named as not read.
    torch.save(edited(lambda st: st.update(gnorm_vec=torch.rand(100))), tmp_path / "clipped.pt")
    insp = json.loads(optstate_cli("inspect", tmp_path / "clipped.pt", "--json").stdout)
    assert "state[0] 'gnorm_vec'" in insp["not_read"], insp["not_read"]


RESUME_BNB = textwrap.dedent("""
    import sys, subprocess, torch, bitsandbytes as bnb
    cli, out = sys.argv[1], sys.argv[2]
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.GELU(), torch.nn.Linear(70, 3))
    def run(m, o, start, stop):
        for s in range(start, stop):
            g = torch.Generator().manual_seed(s)
            m(torch.randn(8, 100, generator=g)).square().sum().backward()
            o.step()
            o.zero_grad()
    m = make()
    o = bnb.optim.AdamW8bit(m.parameters(), lr=1e-3)
    run(m, o, 0, 3)
    torch.save(o.state_dict(), out + ".optimizer.pt")
    torch.save(m.state_dict(), out + ".model.pt")
    run(m, o, 3, 6)
    # Through optstate's own format and back to bitsandbytes' layout (nested, as this release saves
    # it, and flat, as releases before 0.49.2 saved it), then resumed by bitsandbytes.
    subprocess.run([cli, "convert", out + ".optimizer.pt", out + ".native"], check=True, capture_output=True)
    for layout, back in (("nested", out + ".back.pt"), ("flat", out + ".flat.pt")):
        subprocess.run([cli, "convert", out + ".native", back, "--format", "bitsandbytes",
                        "--bitsandbytes-layout", layout], check=True, capture_output=True)
        saved = torch.load(back)
        assert ("__bnb_optimizer_quant_state__" in saved["state"][0]) == (layout == "nested"), layout
        m2 = make()
        m2.load_state_dict(torch.load(out + ".model.pt"))
        o2 = bnb.optim.AdamW8bit(m2.parameters(), lr=1e-3)
        o2.load_state_dict(saved)
        run(m2, o2, 3, 6)
        for a, b in zip(m.parameters(), m2.parameters()):
            assert torch.equal(a, b), layout
        for a, b in zip(o.state.values(), o2.state.values()):
            assert a["step"] == b["step"] == 6 and torch.equal(a["state1"], b["state1"]) and \
                torch.equal(a["state2"], b["state2"]), layout
    print("ok")
""")


def test_bitsandbytes_resumes_bitwise_from_the_state_optstate_writes(tmp_path, optstate_cli):
    from conftest import BUILD
    run_script(tmp_path, RESUME_BNB, "resume_bnb.py", BUILD / "optstate", tmp_path / "r")
    back, orig = tmp_path / "r.back.pt", tmp_path / "r.optimizer.pt"
    assert "(bitsandbytes)" in optstate_cli("inspect", back).stdout
    assert hashes(optstate_cli, back) == hashes(optstate_cli, orig)


def test_bitsandbytes_files_keep_their_layout_flat_before_0_49_2_or_nested(tmp_path, optstate_cli):
    """bitsandbytes 0.49.2 nests a param's state tensors in "__bnb_optimizer_quant_state__"; earlier
    releases keep them beside "step" and load only that layout. A conversion of either kind of file
    writes its layout (state unchanged), --bitsandbytes-layout the other; from another optimizer's
    state the nested one, saying which releases load it."""
    import bitsandbytes as bnb
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 70)
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randn(4, 100)).square().sum().backward()
    opt.step()
    nested = opt.state_dict()
    flat = {"state": {i: {"step": st["step"], **st["__bnb_optimizer_quant_state__"]} for i, st in nested["state"].items()},
            "param_groups": nested["param_groups"]}  # what bitsandbytes 0.49.1 and earlier save
    torch.save(nested, tmp_path / "nested.pt")
    torch.save(flat, tmp_path / "flat.pt")

    def layout(path):
        return "nested" if "__bnb_optimizer_quant_state__" in torch.load(path)["state"][0] else "flat"

    for src in ("nested", "flat"):
        other = "flat" if src == "nested" else "nested"
        kept, switched = tmp_path / f"{src}-kept.pt", tmp_path / f"{src}-switched.pt"
        proc = optstate_cli("convert", tmp_path / f"{src}.pt", kept, "--format", "bitsandbytes")
        assert layout(kept) == src and "__bnb_optimizer_quant_state__" not in proc.stderr, proc.stderr
        optstate_cli("convert", tmp_path / f"{src}.pt", switched, "--format", "bitsandbytes", "--bitsandbytes-layout", other)
        assert layout(switched) == other
        for out in (kept, switched):
            assert hashes(optstate_cli, out) == hashes(optstate_cli, tmp_path / "nested.pt"), out
            state = torch.load(out)["state"][0]
            state.update(state.pop("__bnb_optimizer_quant_state__", {}))
            assert set(state) == set(flat["state"][0]), (out, set(state))
            for k, v in flat["state"][0].items():
                assert torch.equal(torch.as_tensor(state[k]), torch.as_tensor(v)), (out, k)
    optstate_cli("convert", tmp_path / "nested.pt", tmp_path / "native")
    proc = optstate_cli("convert", tmp_path / "native", tmp_path / "from-native.pt", "--format", "bitsandbytes")
    assert layout(tmp_path / "from-native.pt") == "nested"
    assert "as bitsandbytes 0.49.2 and later save and load them; for earlier releases: --bitsandbytes-layout flat" \
        in proc.stderr, proc.stderr
    err = run_err(optstate_cli, "convert", tmp_path / "native", tmp_path / "x.pt", "--format", "bitsandbytes",
                  "--bitsandbytes-layout", "wrapped")
    assert "--bitsandbytes-layout must be nested or flat, got 'wrapped'" in err, err
    err = run_err(optstate_cli, "convert", tmp_path / "native", tmp_path / "x.pt", "--bitsandbytes-layout", "flat")
    assert "--bitsandbytes-layout is for --format bitsandbytes" in err, err


def test_torch_and_torchao_state_move_to_bitsandbytes_8bit(tmp_path, optstate_cli):
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from torchao.optim import AdamW8bit as AoAdamW8bit

    def trained(make):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.GELU(), torch.nn.Linear(70, 3))
        opt = make(model.parameters())
        for _ in range(3):
            model(torch.randn(8, 100)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    # torch.optim.AdamW (fp32) -> bitsandbytes' 8-bit state: quantized here (blocks of 256, nearest code).
    model, opt = trained(lambda p: torch.optim.AdamW(p, lr=1e-3))
    torch.save(opt.state_dict(), tmp_path / "torch.pt")
    optstate_cli("convert", tmp_path / "torch.pt", tmp_path / "bnb.pt", "--format", "bitsandbytes", "--to", "8bit",
                 "--block-size", "256")
    sd = torch.load(tmp_path / "bnb.pt")
    st = sd["state"][0]["__bnb_optimizer_quant_state__"]
    assert st["state1"].dtype == torch.uint8 and sd["state"][1]["__bnb_optimizer_quant_state__"]["state1"].dtype == torch.float32
    for n, k in (("1", "exp_avg"), ("2", "exp_avg_sq")):
        x = opt.state[model[0].weight][k]
        codes, qs = F.quantize_blockwise(x, code=st["qmap" + n], blocksize=256)
        assert torch.equal(qs.absmax, st["absmax" + n])
        # Every code is a nearest one: at least as near as bitsandbytes' own quantizer's, whose pivot
        # search picks the neighbour in a few elements (docs: formats/bitsandbytes/FORMAT.md).
        scale = st["absmax" + n].repeat_interleave(256)[: x.numel()].view_as(x)
        ours = (st["qmap" + n][st["state" + n].long()] * scale - x).abs()
        theirs = (st["qmap" + n][codes.long()] * scale - x).abs()
        assert bool((ours <= theirs).all())
    resumed = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    resumed.load_state_dict(sd)
    model(torch.randn(8, 100)).square().sum().backward()
    resumed.step()
    assert resumed.state[model[0].weight]["step"] == 4
    assert resumed.state[model[0].weight]["state1"].dtype == torch.uint8

    # torchao's AdamW8bit (blocks of 256): its codes and scales carry over as they are.
    _, ao = trained(lambda p: AoAdamW8bit(p, lr=1e-3, block_size=256))
    torch.save(ao.state_dict(), tmp_path / "ao.pt")
    optstate_cli("convert", tmp_path / "ao.pt", tmp_path / "ao_bnb.pt", "--format", "bitsandbytes")
    assert hashes(optstate_cli, tmp_path / "ao_bnb.pt") == hashes(optstate_cli, tmp_path / "ao.pt")
    # torchao's blocks of 128: requantized into bitsandbytes' 256 in one step when --block-size says
    # so, the codes of dequantizing first (two converts) exactly; bitsandbytes steps them as 8-bit.
    torch.manual_seed(0)
    m128 = torch.nn.Linear(128, 64)  # 8192 weights: whole blocks of 128 and of 256
    ao128 = AoAdamW8bit(m128.parameters(), lr=1e-3, block_size=128)
    for _ in range(3):
        m128(torch.randn(8, 128)).square().sum().backward()
        ao128.step()
        ao128.zero_grad()
    torch.save(ao128.state_dict(), tmp_path / "ao128.pt")
    assert "8bit/128" in optstate_cli("inspect", tmp_path / "ao128.pt", "--no-stats").stdout
    kept = optstate_cli("convert", tmp_path / "ao128.pt", tmp_path / "kept.pt", "--format", "bitsandbytes")
    assert "stores 2 8-bit entries as fp32 values" in kept.stderr, kept.stderr
    one = optstate_cli("convert", tmp_path / "ao128.pt", tmp_path / "one.pt", "--format", "bitsandbytes", "--to", "8bit",
                       "--block-size", "256")
    assert "as fp32 values" not in one.stderr, one.stderr
    optstate_cli("convert", tmp_path / "ao128.pt", tmp_path / "f32.safetensors", "--to", "fp32")
    optstate_cli("convert", tmp_path / "f32.safetensors", tmp_path / "two.pt", "--format", "bitsandbytes", "--to",
                 "8bit", "--block-size", "256")
    assert hashes(optstate_cli, tmp_path / "one.pt") == hashes(optstate_cli, tmp_path / "two.pt")
    st128 = torch.load(tmp_path / "one.pt")["state"][0]["__bnb_optimizer_quant_state__"]
    assert st128["state1"].dtype == torch.uint8 and st128["absmax1"].numel() == 8192 // 256
    bnb128 = bnb.optim.AdamW8bit(m128.parameters(), lr=1e-3)
    bnb128.load_state_dict(torch.load(tmp_path / "one.pt"))
    m128(torch.randn(8, 128)).square().sum().backward()
    bnb128.step()
    assert bnb128.state[m128.weight]["state1"].dtype == torch.uint8
    # bitsandbytes' AdamW has no amsgrad: refused by name, nothing written.
    _, ams = trained(lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True))
    torch.save(ams.state_dict(), tmp_path / "ams.pt")
    err = run_err(optstate_cli, "convert", tmp_path / "ams.pt", tmp_path / "ams_bnb.pt", "--format", "bitsandbytes")
    assert "amsgrad" in err and not (tmp_path / "ams_bnb.pt").exists()


def test_optstate_load_by_position_takes_numbered_optimizer_pt_as_torch_load_state_dict_does(tmp_path, optstate_cli):
    # Hugging Face's Trainer saves optimizer.pt of an optimizer built from params, not names: the
    # state is numbered. by_position matches it as torch's optimizer.load_state_dict does.
    run_python(f"""
        import logging, torch, optstate, bitsandbytes as bnb
        logging.disable(logging.WARNING)
        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(100, 70), torch.nn.GELU(), torch.nn.Linear(70, 3))
        def groups(m):  # the Trainer's two groups: weights decayed, the rest not
            return [{{"params": [p for p in m.parameters() if p.dim() > 1], "weight_decay": 0.05}},
                    {{"params": [p for p in m.parameters() if p.dim() <= 1], "weight_decay": 0.0}}]
        m = make()
        o = bnb.optim.AdamW8bit(groups(m), lr=1e-3)
        for s in range(3):
            m(torch.randn(8, 100)).square().sum().backward()
            o.step()
            o.zero_grad()
        path = {str(tmp_path / "optimizer.pt")!r}
        torch.save(o.state_dict(), path)
        m2 = make()
        o2 = optstate.AdamW8bit(groups(m2), lr=0.5, block_size=256)
        try:
            optstate.load(path, m2, o2)
            raise AssertionError("numbered params matched by name")
        except KeyError as e:
            assert "by_position=True" in str(e), e
        optstate.load(path, m2, o2, by_position=True)
        assert optstate.verify(path, m2, o2, by_position=True) == []
        live = [p for g in o2.param_groups for p in g["params"]]
        theirs = [p for g in o.param_groups for p in g["params"]]
        for p2, p in zip(live, theirs):
            st2, st = o2.state[p2], o.state[p]
            assert st2["step"].item() == st["step"] == 3
            if st["state1"].dtype == torch.uint8:  # bitsandbytes' codes and scales, as they are
                assert torch.equal(st2["exp_avg_codes"], st["state1"]) and torch.equal(st2["exp_avg_absmax"], st["absmax1"])
                assert torch.equal(st2["exp_avg_sq_codes"], st["state2"])
            else:
                assert torch.equal(st2["exp_avg"], st["state1"]) and torch.equal(st2["exp_avg_sq"], st["state2"])
        assert [g["weight_decay"] for g in o2.param_groups] == [0.05, 0.0] and o2.param_groups[0]["lr"] == 1e-3
        m2(torch.randn(8, 100)).square().sum().backward()
        o2.step()
        # Other groups than the file's: refused, as torch refuses them, with nothing changed.
        o3 = optstate.FusedAdamW(m2.parameters(), lr=0.5)
        try:
            optstate.load(path, m2, o3, by_position=True)
            raise AssertionError("loaded into other groups")
        except ValueError as e:
            assert "2 param groups, the optimizer 1" in str(e), e
        assert o3.state == {{}} or all(len(v) == 0 for v in o3.state.values())
        print("ok")
    """)


# ---- torchao's AdamW8bit state_dict, written (formats/torchao/) ----

@pytest.fixture
def torchao_eager():
    """torchao's step without torch.compile (its eager single_param_adam): the same kernel in every
    run compared here, and no 20 s compile per shape on this CPU."""
    import torchao.optim.adam as tadam
    saved = tadam.torch.compile
    tadam.torch.compile = lambda fn, **kw: fn
    yield
    tadam.torch.compile = saved


def _ao_model(dtype=torch.float32):
    torch.manual_seed(0)
    # 128*96 = 48 blocks of 256: 8-bit in torchao; 96*50 = 4800 >= 4096 but no whole number of
    # blocks: plain in torchao; the biases: small, plain.
    return torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.GELU(), torch.nn.Linear(96, 50)).to(dtype)


def _ao_train(model, opt, steps):
    dtype = next(model.parameters()).dtype
    for s in steps:
        g = torch.Generator().manual_seed(s)
        model(torch.randn(8, 128, generator=g).to(dtype)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()


def _assert_same_torchao_state(a, b):
    assert a["param_groups"] == b["param_groups"] or all(
        {k: v for k, v in ga.items() if k != "lr"} == {k: v for k, v in gb.items() if k != "lr"}
        and torch.equal(ga["lr"], gb["lr"]) for ga, gb in zip(a["param_groups"], b["param_groups"]))
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys(), k
        for n, x in a["state"][k].items():
            y = b["state"][k][n]
            assert type(x) is type(y), (k, n)
            if hasattr(x, "codes"):  # OptimState8bit
                assert torch.equal(x.codes, y.codes) and torch.equal(x.scale, y.scale) and torch.equal(x.qmap, y.qmap)
                assert (x.signed, x.block_size, x.shape, x.dtype) == (y.signed, y.block_size, y.shape, y.dtype)
            else:
                assert x.dtype == y.dtype and torch.equal(x, y), (k, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_optimizer_pt_converted_and_written_back_resumes_bit_for_bit(tmp_path, optstate_cli, torchao_eager,
                                                                             dtype):
    """torchao's AdamW8bit optimizer.pt -> native (optstate's own) -> --format torchao: the same
    state_dict, tensor for tensor (bf16 params: bf16 plain moments, OptimState8bit claiming bf16);
    torchao loads it (torch.load's weights_only default) and ends where the uninterrupted run ends,
    bit for bit."""
    import copy
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit
    model = _ao_model(dtype)
    opt = AdamW8bit(model.named_parameters(), lr=1e-3, weight_decay=0.05)
    _ao_train(model, opt, range(3))
    torch.save(opt.state_dict(), tmp_path / "ao.pt")
    at3 = copy.deepcopy(model)
    _ao_train(model, opt, range(3, 6))  # the uninterrupted run

    optstate_cli("convert", tmp_path / "ao.pt", tmp_path / "native")
    done = optstate_cli("convert", tmp_path / "native", tmp_path / "back.pt", "--format", "torchao")
    assert "(torchao, 1 rank)" in done.stdout and "as fp32 values" not in done.stderr
    assert "(torchao)" in optstate_cli("inspect", tmp_path / "ao.pt").stdout
    assert "(torchao)" in optstate_cli("inspect", tmp_path / "back.pt").stdout
    assert hashes(optstate_cli, tmp_path / "back.pt") == hashes(optstate_cli, tmp_path / "ao.pt")
    written = torch.load(tmp_path / "back.pt")
    _assert_same_torchao_state(written, torch.load(tmp_path / "ao.pt"))
    assert type(written["state"][0]["exp_avg"]) is OptimState8bit
    assert type(written["state"][2]["exp_avg"]) is torch.Tensor  # 4800 elements: torchao's own fp32

    resumed = AdamW8bit(at3.named_parameters(), lr=1e-3, weight_decay=0.05)
    resumed.load_state_dict(written)
    _ao_train(at3, resumed, range(3, 6))
    for (name, p), q in zip(model.named_parameters(), at3.parameters()):
        assert torch.equal(p, q), name
    _assert_same_torchao_state(resumed.state_dict(), opt.state_dict())

    # amsgrad's max_exp_avg_sq (torchao steps amsgrad compiled only; its state is built here with
    # torchao's own buffers and quantizing copy_): the same round trip, tensor for tensor.
    ams = AdamW8bit(at3.parameters(), lr=1e-3, amsgrad=True)
    for p in at3.parameters():
        st = ams.state[p]
        st["step"] = torch.tensor(3.0)
        for k, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
            st[k] = ams._new_buffer(p, signed)
            st[k].copy_(torch.randn_like(p) if signed else torch.rand_like(p))
    torch.save(ams.state_dict(), tmp_path / "ams.pt")
    optstate_cli("convert", tmp_path / "ams.pt", tmp_path / "ams_native")
    optstate_cli("convert", tmp_path / "ams_native", tmp_path / "ams_back.pt", "--format", "torchao")
    written = torch.load(tmp_path / "ams_back.pt")
    assert type(written["state"][0]["max_exp_avg_sq"]) is OptimState8bit and written["param_groups"][0]["amsgrad"]
    _assert_same_torchao_state(written, torch.load(tmp_path / "ams.pt"))


def test_torch_bnb_and_optstate_state_move_into_torchao_8bit(tmp_path, optstate_cli, torchao_eager):
    import bitsandbytes as bnb
    import optstate
    from torchao.optim import AdamW8bit
    from torchao.optim.quant_utils import quantize_8bit_with_qmap, scale_tensor
    from torchao.optim.subclass_8bit import OptimState8bit

    # torch.optim.AdamW (fp32) -> torchao's 8-bit state, quantized by optstate: torchao's own codes
    # (its quantize_8bit_with_qmap of the same moments), where torchao would quantize them.
    model = _ao_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    _ao_train(model, opt, range(3))
    torch.save(opt.state_dict(), tmp_path / "torch.pt")
    done = optstate_cli("convert", tmp_path / "torch.pt", tmp_path / "ao.pt", "--format", "torchao", "--to", "8bit")
    assert "as fp32 values" not in done.stderr  # 4800 elements: left fp32, not quantized then widened
    sd = torch.load(tmp_path / "ao.pt")
    assert isinstance(sd["param_groups"][0]["lr"], torch.Tensor)
    for i, p in enumerate(model.parameters()):
        st = sd["state"][i]
        assert st["step"].dtype == torch.float32 and st["step"].item() == 3
        for k in ("exp_avg", "exp_avg_sq"):
            x = opt.state[p][k]
            if i == 0:
                assert type(st[k]) is OptimState8bit and st[k].block_size == 256
                scaled, scale = scale_tensor(x, 256)
                assert torch.equal(st[k].scale, scale)
                assert torch.equal(st[k].codes, quantize_8bit_with_qmap(scaled, st[k].qmap).view(x.shape))
            else:  # below 4096 elements, or 4800 (no whole blocks): the moments as they were
                assert type(st[k]) is torch.Tensor and torch.equal(st[k], x)
    resumed = AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.05)
    resumed.load_state_dict(sd)
    _ao_train(model, resumed, range(3, 4))
    assert resumed.state[model[0].weight]["step"].item() == 4
    assert type(resumed.state[model[0].weight]["exp_avg"]) is OptimState8bit

    # bitsandbytes' AdamW8bit (blocks of 256) and optstate's AdamW8bit: codes and scales carry over
    # as they are; optstate's 4800-element param (a partial last block) becomes its fp32 values.
    for name, make in (("bnb", lambda p: bnb.optim.AdamW8bit(p, lr=1e-3)),
                       ("ours", lambda p: optstate.AdamW8bit(p, lr=1e-3, block_size=256))):
        model = _ao_model()
        src = make(model.parameters())
        _ao_train(model, src, range(3))
        torch.save(src.state_dict(), tmp_path / f"{name}.pt")
        done = optstate_cli("convert", tmp_path / f"{name}.pt", tmp_path / f"{name}_ao.pt", "--format", "torchao")
        sd = torch.load(tmp_path / f"{name}_ao.pt")
        st = sd["state"][0]
        w = src.state[model[0].weight]
        codes = w["state1"] if name == "bnb" else w["exp_avg_codes"]
        absmax = w["absmax1"] if name == "bnb" else w["exp_avg_absmax"]
        assert torch.equal(st["exp_avg"].codes, codes) and torch.equal(st["exp_avg"].scale, absmax)
        assert type(sd["state"][2]["exp_avg"]) is torch.Tensor
        if name == "ours":
            assert "stores 2 8-bit entries as fp32 values" in done.stderr
        resumed = AdamW8bit(model.parameters(), lr=1e-3)
        resumed.load_state_dict(sd)
        _ao_train(model, resumed, range(3, 4))

    # torchao has no maximize: refused by name, nothing written.
    model = _ao_model()
    mx = torch.optim.AdamW(model.parameters(), lr=1e-3, maximize=True)
    _ao_train(model, mx, range(1))
    torch.save(mx.state_dict(), tmp_path / "max.pt")
    err = run_err(optstate_cli, "convert", tmp_path / "max.pt", tmp_path / "max_ao.pt", "--format", "torchao")
    assert "maximize" in err and not (tmp_path / "max_ao.pt").exists()


def test_torchao_file_without_8bit_moments_sniffs_as_torchao_not_torch(tmp_path, optstate_cli, torchao_eager):
    """Every param below 4096 elements: torchao's file holds no subclass, only its groups (lr a
    tensor, no 'maximize') tell it; torch.optim.AdamW with a tensor lr still reads as torch's."""
    from torchao.optim import AdamW8bit
    model = torch.nn.Linear(16, 8)
    ao = AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    ao.step()
    torch.save(ao.state_dict(), tmp_path / "small_ao.pt")
    assert "(torchao)" in optstate_cli("inspect", tmp_path / "small_ao.pt").stdout
    ta = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    ta.step()
    torch.save(ta.state_dict(), tmp_path / "tensor_lr.pt")
    assert "(torchsave)" in optstate_cli("inspect", tmp_path / "tensor_lr.pt").stdout


def test_torch_adam_with_weight_decay_is_refused_as_not_adamw_and_without_reads(tmp_path, optstate_cli):
    """torch.optim.Adam adds weight decay to the gradient (L2), AdamW decays the weights: other
    updates, so Adam's state with decay is refused by name, in torch.save files and DCPs alike;
    without decay the two are one update and it reads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    for wd in (0.1, 0.0):
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.Adam(model.named_parameters(), weight_decay=wd)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        torch.save(opt.state_dict(), tmp_path / f"adam_{wd}.pt")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / f"adam_{wd}.dcp"))
        for f in (f"adam_{wd}.pt", f"adam_{wd}.dcp"):
            if wd:
                err = run_err(optstate_cli, "convert", tmp_path / f, tmp_path / (f + ".safetensors"))
                assert "decoupled_weight_decay=False with weight_decay 0.1" in err and "not AdamW" in err, err
            else:
                optstate_cli("convert", tmp_path / f, tmp_path / (f + ".safetensors"))


# Training loops that torch.save {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
# with an optimizer built from parameters (no param_names): nanoGPT (decay / no-decay groups, a tied
# embedding), Lightning (its "state_dict" and "optimizer_states"), a CNN with BatchNorm buffers, a
# LoRA's adapters alone; and one whose frozen param is shaped like its neighbour (ambiguous).
GPT_MODEL = textwrap.dedent("""
    import torch, torch.nn as nn
    class Block(nn.Module):
        def __init__(s, d):
            super().__init__()
            s.ln_1, s.attn, s.proj, s.ln_2 = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d)
            s.fc, s.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        def forward(s, x):
            x = x + s.proj(s.attn(s.ln_1(x))[..., : x.shape[-1]])
            return x + s.out(torch.relu(s.fc(s.ln_2(x))))

    class GPT(nn.Module):
        def __init__(s, d=16, vocab=40, n=2):
            super().__init__()
            s.wte, s.wpe = nn.Embedding(vocab, d), nn.Embedding(8, d)
            s.h, s.ln_f = nn.ModuleList(Block(d) for _ in range(n)), nn.LayerNorm(d)
            s.lm_head = nn.Linear(d, vocab, bias=False)
            s.lm_head.weight = s.wte.weight  # tied, as nanoGPT ties them
        def forward(s, idx):
            x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1]))
            for b in s.h:
                x = b(x)
            return s.lm_head(s.ln_f(x))
""")
MAKE_NUMBERED = GPT_MODEL + textwrap.dedent("""
    import sys, json, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    kind, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)

    if kind in ("nanogpt", "lightning", "compiled", "compiled_named"):
        model = GPT()
        data = lambda g: (model, torch.randint(0, 40, (4, 8), generator=g))
    elif kind == "cnn":
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                              nn.Flatten(), nn.Linear(8 * 4 * 4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        data = lambda g: (model, torch.randn(4, 3, 8, 8, generator=g))
    elif kind == "lora":
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 2, bias=False), nn.Linear(2, 16, bias=False),
                              nn.Linear(16, 16), nn.Linear(16, 2, bias=False), nn.Linear(2, 16, bias=False))
        for i in (0, 3):
            model[i].requires_grad_(False)  # the base weights are frozen; only the adapters train
        data = lambda g: (model, torch.randn(4, 16, generator=g))
    else:  # ambiguous: a frozen weight between two trainable ones of its shape
        model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
        model[1].weight.requires_grad_(False)
        data = lambda g: (model, torch.randn(4, 8, generator=g))

    if kind == "compiled_named":  # compiled first: named_parameters() says '_orig_mod.wte.weight'
        model = torch.compile(model, backend="eager")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind != "compiled_named":
        assert not any("_orig_mod" in n for n, _ in named)
    if kind in ("nanogpt", "lightning", "compiled", "compiled_named"):  # nanoGPT's configure_optimizers
        decay = [(n, p) for n, p in named if p.dim() >= 2]
        nodecay = [(n, p) for n, p in named if p.dim() < 2]
        if kind == "compiled_named":  # param_names, torch >= 2.6
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                     {"params": nodecay, "weight_decay": 0.0}], lr=1e-3)
        else:
            opt = torch.optim.AdamW([{"params": [p for _, p in decay], "weight_decay": 0.1},
                                     {"params": [p for _, p in nodecay], "weight_decay": 0.0}], lr=1e-3)
        order = [[n.removeprefix("_orig_mod.") for n, _ in decay], [n.removeprefix("_orig_mod.") for n, _ in nodecay]]
        if kind == "compiled":  # nanoGPT's train.py: the optimizer first, then torch.compile
            model = torch.compile(model, backend="eager")
    else:
        opt = torch.optim.AdamW([p for _, p in named], lr=1e-3)
        order = [[n for n, _ in named]]
    for step in range(3):
        m, x = data(torch.Generator().manual_seed(step))
        m(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    if kind == "lightning":
        sched = torch.optim.lr_scheduler.StepLR(opt, 10)
        torch.save({"epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.5.0",
                    "state_dict": model.state_dict(), "loops": {}, "callbacks": {},
                    "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()]}, out + ".pt")
    else:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 3}, out + ".pt")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out + ".dcp")
    json.dump(order, open(out + ".order.json", "w"))
""")


def make_numbered(tmp_path, kind):
    out = tmp_path / kind
    run_script(tmp_path, MAKE_NUMBERED, "make_numbered.py", kind, out)
    return f"{out}.pt", f"{out}.dcp", json.loads(open(f"{out}.order.json").read())


@pytest.mark.parametrize("kind", ["nanogpt", "lightning", "cnn", "lora", "compiled", "compiled_named"])
def test_numbered_params_beside_their_model_are_named_after_it(tmp_path, optstate_cli, kind):
    """compiled: nanoGPT's train.py with compile=True (its default) saves the compiled model's
    state_dict, every key under '_orig_mod.'; compiled_named: an optimizer given the compiled
    model's named_parameters() (param_names '_orig_mod.wte.weight'). The state is named as torch's
    state dicts name it ('wte.weight'), as the same run's DCP is."""
    pt, ck, groups = make_numbered(tmp_path, kind)
    order = [n for g in groups for n in g]
    insp = json.loads(optstate_cli("inspect", pt, "--json").stdout)
    # Each param id torch numbered gets the name named_parameters() gives it (tied weights once, under
    # their first name; norm buffers and frozen params passed over), and its weights.
    assert sorted(insp["params"]) == sorted(order)
    assert [g["params"] for g in insp["param_groups"]] == [len(g) for g in groups]
    assert all(insp["params"][n]["group"] == g for g, names in enumerate(groups) for n in names)
    assert all(insp["params"][n]["entries"].get("param") for n in order)
    assert not any("keep their numbers" in s for s in insp["not_read"])
    # So the file is the state the same run's DCP holds, entry for entry, where the DCP holds the same.
    ours, theirs = hashes(optstate_cli, pt)["entries"], hashes(optstate_cli, ck)["entries"]
    assert ours == {k: v for k, v in theirs.items() if k.rsplit(".", 1)[0] in order}
    # And converted to a DCP, torch's own set_state_dict takes it by name into a fresh model and AdamW.
    optstate_cli("convert", pt, tmp_path / "out.dcp", "--format", "dcp")
    if kind.startswith("compiled"):
        # Written back as a torch.save file, the loop's own keys stay ('_orig_mod.' for nanoGPT's
        # resume to strip), each holding its weights.
        optstate_cli("convert", pt, tmp_path / "back.pt")
        src, back = torch.load(pt, weights_only=True), torch.load(tmp_path / "back.pt", weights_only=True)
        assert list(back["model"]) == list(src["model"]) and all(k.startswith("_orig_mod.") for k in src["model"])
        assert all(torch.equal(back["model"][k], v) for k, v in src["model"].items())
        names = [n for g in back["optimizer"]["param_groups"] for n in g["param_names"]]
        assert names == order
        assert hashes(optstate_cli, tmp_path / "back.pt") == hashes(optstate_cli, pt)  # read again: the same
    if kind in ("nanogpt", "lightning", "compiled", "compiled_named"):
        run_script(tmp_path, GPT_MODEL + textwrap.dedent(f"""
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            sd = torch.load({pt!r}, weights_only=True)
            src = sd["optimizer_states"][0] if "optimizer_states" in sd else sd["optimizer"]
            model = GPT()
            named = [(n, p) for n, p in model.named_parameters()]
            decay = [p for n, p in named if p.dim() >= 2]
            nodecay = [p for n, p in named if p.dim() < 2]
            opt = torch.optim.AdamW([{{"params": decay, "weight_decay": 0.1}}, {{"params": nodecay, "weight_decay": 0.0}}])
            msd, osd = get_state_dict(model, opt)
            # strict: every key of get_state_dict, the tied head's second name too (the model's
            # other tensors, written beside the weights)
            dcp.load({{"model": msd, "optim": osd}}, checkpoint_id={str(tmp_path / "out.dcp")!r})
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            got = opt.state_dict()
            for i in range(len(decay) + len(nodecay)):
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(got["state"][i][k], src["state"][i][k]), (i, k)
            saved = sd["state_dict"] if "state_dict" in sd else sd["model"]
            saved = {{k.removeprefix("_orig_mod."): v for k, v in saved.items()}}
            assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
            assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        """), "load_numbered.py")
    if kind == "cnn":  # BatchNorm's running stats and counts go along: a strict load gets them all
        run_script(tmp_path, textwrap.dedent(f"""
            import torch, torch.nn as nn, torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                                  nn.Flatten(), nn.Linear(8 * 4 * 4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            msd, osd = get_state_dict(model, opt)
            dcp.load({{"model": msd, "optim": osd}}, checkpoint_id={str(tmp_path / "out.dcp")!r})
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            saved = torch.load({pt!r}, weights_only=True)["model"]
            assert model.state_dict().keys() == saved.keys()
            assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
            assert int(model[1].num_batches_tracked) == 3
        """), "load_numbered.py")
    # The run's own DCP written as a torch.save file: its model dict is the model's whole state dict
    # (BatchNorm's stats and counts, the tied head, LoRA's frozen base weights beside the params'),
    # every key a strict load_state_dict asks for, each tensor as the run saved it.
    optstate_cli("convert", ck, tmp_path / "from_dcp.pt", "--format", "torchsave")
    got = torch.load(tmp_path / "from_dcp.pt", weights_only=True)["model"]
    sd = torch.load(pt, weights_only=True)
    saved = {k.removeprefix("_orig_mod."): v for k, v in sd["state_dict" if "state_dict" in sd else "model"].items()}
    assert sorted(got) == sorted(saved)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in saved.items())


def test_a_damaged_model_buffer_fails_the_dcp_write_by_name_and_leaves_nothing(tmp_path, optstate_cli):
    """The model's other tensors a DCP write carries are checked against torch.save's CRC-32 as the
    state is: a flipped byte in a BatchNorm buffer fails the convert, naming the file and the key,
    and no DST is left; formats that do not keep them still convert."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    pt = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
    raw = bytearray(pt.read_bytes())
    want = model[1].running_var.detach().numpy().tobytes()
    with zipfile.ZipFile(pt) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and z.read(i) == want)
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:][:2], "little"), \
        int.from_bytes(raw[info.header_offset + 28:][:2], "little")
    raw[info.header_offset + 30 + name_len + extra_len + 5] ^= 0x40
    pt.write_bytes(bytes(raw))
    err = run_err(optstate_cli, "convert", pt, tmp_path / "out.dcp", "--format", "dcp")
    assert "ckpt.pt: ['model']['1.running_var']: CRC-32 of its storage" in err, err
    assert not (tmp_path / "out.dcp").exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    optstate_cli("convert", pt, tmp_path / "out.safetensors")  # the state itself is whole


def test_a_damaged_dcp_buffer_fails_the_torchsave_write_by_name_and_leaves_nothing(tmp_path, optstate_cli):
    """A DCP's model buffers a torch.save write puts in its model dict are checked against the
    CRC-32 torch.save stored for their item: a flipped byte fails the convert naming the item, and
    no file is left; formats that do not keep them still convert."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    ck = tmp_path / "ckpt.dcp"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)
    # Whole, they go into the model dict of every torch.save writer's file, as the model holds them.
    for fmt in ("torchsave", "torchao", "bitsandbytes"):
        good = optstate_cli("convert", ck, tmp_path / "good.pt", "--format", fmt).stdout
        assert "kept the model's 3 other tensors (1.num_batches_tracked, 1.running_mean, 1.running_var)" in good, good
        got = torch.load(tmp_path / "good.pt", weights_only=False)["model"]
        assert sorted(got) == sorted(model.state_dict())
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in model.state_dict().items()), fmt
        (tmp_path / "good.pt").unlink()
    data = ck / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    want = model[1].running_var.detach().numpy().tobytes()
    assert raw.count(want) == 1
    raw[raw.find(want) + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    err = run_err(optstate_cli, "convert", ck, tmp_path / "out.pt", "--format", "torchsave")
    assert "item 'model.1.running_var'" in err and "fails the CRC-32 torch.save stored" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.dcp"]
    optstate_cli("convert", ck, tmp_path / "out.safetensors")  # the state itself is whole


def test_params_whose_names_are_one_once_wrappers_are_dropped_are_refused(tmp_path, optstate_cli):
    """A module registered as '_orig_mod' beside '0' (what no torch.compile makes): its params and
    the model's would share the names torch's state dicts give them; not one state's."""
    clash = torch.nn.Sequential(torch.nn.Linear(4, 4))
    clash.register_module("_orig_mod", torch.nn.Sequential(torch.nn.Linear(4, 4)))
    opt = torch.optim.AdamW(clash.named_parameters())
    clash(torch.randn(2, 4)).sum().backward()
    clash._orig_mod(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "clash.pt")
    err = run_err(optstate_cli, "inspect", tmp_path / "clash.pt")
    assert "clash.pt: params '0.weight' and '_orig_mod.0.weight' both have the name '0.weight'" in err, err


def test_numbered_params_that_fit_the_model_more_than_one_way_keep_their_numbers(tmp_path, optstate_cli):
    pt, _, _ = make_numbered(tmp_path, "ambiguous")
    insp = json.loads(optstate_cli("inspect", pt, "--json").stdout)
    assert sorted(insp["params"]) == ["0", "1"]
    assert any(s.startswith("['model'] (the model's tensors: the optimizer's 2 params (in 1 group) fit among its 3 "
                            "tensors in more than one way") for s in insp["not_read"]), insp["not_read"]


@pytest.mark.parametrize("dst", ["plain.pt", "torchao.pt", "bnb.pt"])
def test_trainers_optimizer_pt_keeps_its_groups_initial_lr(tmp_path, optstate_cli, dst):
    """Hugging Face Trainer's optimizer.pt is the optimizer's state_dict alone, its groups holding the
    LR scheduler's 'initial_lr'. Converted (to torch.optim.AdamW's, torchao's or bitsandbytes' 8-bit
    state), the groups keep it: a scheduler built to resume (last_epoch > -1, as a loop that rebuilds
    it does) asks for it, and fails without it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    args = {"plain.pt": (), "torchao.pt": ("--format", "torchao", "--to", "8bit"),
            "bnb.pt": ("--format", "bitsandbytes", "--to", "8bit")}[dst]
    proc = optstate_cli("convert", tmp_path / "optimizer.pt", tmp_path / dst, *args)
    assert "initial_lr" not in proc.stderr and "kept param group 0 'initial_lr'" in proc.stdout, \
        (proc.stdout, proc.stderr)
    osd = torch.load(tmp_path / dst, weights_only=dst != "torchao.pt")
    assert [g["initial_lr"] for g in osd["param_groups"]] == [1e-3]
    if dst != "plain.pt":
        return
    resumed = torch.optim.AdamW(model.parameters(), lr=1e-3)
    resumed.load_state_dict(osd)
    rebuilt = torch.optim.lr_scheduler.LambdaLR(resumed, lambda s: 1.0 / (s + 1), last_epoch=3)
    assert rebuilt.base_lrs == [1e-3]


@pytest.mark.parametrize("layout", ["nanogpt", "lightning"])
def test_converted_training_checkpoint_keeps_its_other_entries_and_resumes(tmp_path, optstate_cli, layout):
    """torchao's AdamW8bit state in a training loop's own file (nanoGPT's {"model", "optimizer",
    "iter_num", "config"}, Lightning's .ckpt), converted to torch.optim.AdamW's: the file keeps all
    the rest (the model's buffers and tied head, the scheduler's state and the groups' initial_lr,
    the loop's counters), so the loop's own strict loading resumes from it."""
    run_script(tmp_path, GPT_MODEL + textwrap.dedent(f"""
        import torch
        from torchao.optim import AdamW8bit
        torch.manual_seed(0)
        model = GPT(d=64)
        model.register_buffer("mask", torch.ones(8))  # a persistent buffer of the root module
        named = list(model.named_parameters())
        decay = [p for n, p in named if p.dim() >= 2]
        nodecay = [p for n, p in named if p.dim() < 2]
        opt = AdamW8bit([{{"params": decay, "weight_decay": 0.1}}, {{"params": nodecay, "weight_decay": 0.0}}],
                        lr=1e-3, block_size=64)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            model(torch.randint(0, 40, (4, 8), generator=g)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        ref = {{i: {{k: (v.dequantize() if hasattr(v, "dequantize") else v).clone() for k, v in st.items()}}
               for i, st in enumerate(opt.state[p] for p in decay + nodecay)}}
        torch.save(ref, {str(tmp_path / "ref.pt")!r})
        if {layout!r} == "lightning":
            ck = {{"epoch": 0, "global_step": 3, "state_dict": model.state_dict(), "loops": {{"fit_loop": {{"n": 3}}}},
                   "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()]}}
        else:
            ck = {{"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 3,
                   "config": {{"d": 64, "lr": 1e-3}}}}
        torch.save(ck, {str(tmp_path / "ckpt.pt")!r})
    """), "make_ckpt.py")
    proc = optstate_cli("convert", tmp_path / "ckpt.pt", tmp_path / "plain.pt")
    assert "; carried unchanged: " in proc.stdout and "note:" not in proc.stderr, (proc.stdout, proc.stderr)
    run_script(tmp_path, GPT_MODEL + textwrap.dedent(f"""
        import torch
        src = torch.load({str(tmp_path / "ckpt.pt")!r}, weights_only=False)
        ck = torch.load({str(tmp_path / "plain.pt")!r}, weights_only=True)  # no torchao needed now
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        assert list(ck) == list(src), (list(ck), list(src))
        lightning = "state_dict" in ck
        msd, osd = (ck["state_dict"], ck["optimizer_states"][0]) if lightning else (ck["model"], ck["optimizer"])
        for k in ck:
            if k not in ("state_dict", "optimizer_states", "model", "optimizer"):
                assert ck[k] == src[k], k
        model = GPT(d=64)
        model.register_buffer("mask", torch.zeros(8))
        model.load_state_dict(msd)  # strict: every key, the tied head's and the buffer's too
        assert torch.equal(model.mask, torch.ones(8)) and model.lm_head.weight is model.wte.weight
        named = list(model.named_parameters())
        decay = [p for n, p in named if p.dim() >= 2]
        nodecay = [p for n, p in named if p.dim() < 2]
        opt = torch.optim.AdamW([{{"params": decay, "weight_decay": 0.1}}, {{"params": nodecay, "weight_decay": 0.0}}],
                                lr=1e-3)
        opt.load_state_dict(osd)
        for i, p in enumerate(decay + nodecay):
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][k], ref[i][k]), (i, k)
            assert opt.state[p]["step"].item() == 3
        # the scheduler's groups field came along, a float as the lr now is (torchao's tensor held
        # 1e-3 rounded to float32); the scheduler resumes from its saved state
        assert [g["initial_lr"] for g in opt.param_groups] == [float(torch.tensor(1e-3))] * 2
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5, last_epoch=2)
        if lightning:
            sched.load_state_dict(ck["lr_schedulers"][0])
        # (torchao keeps lr as a float32 tensor: 5e-4 rounded to float32)
        assert all(abs(float(x) - 5e-4) < 1e-10 for x in sched.get_last_lr()), sched.get_last_lr()
        g = torch.Generator().manual_seed(3)
        model(torch.randint(0, 40, (4, 8), generator=g)).float().square().mean().backward()
        opt.step()
    """), "resume.py")


@pytest.mark.parametrize("target", ["torchao", "bitsandbytes"])
def test_training_checkpoint_moves_to_an_8bit_optimizer_keeping_its_other_entries(tmp_path, optstate_cli, target):
    """The other way: nanoGPT's file of torch.optim.AdamW state written as torchao's or
    bitsandbytes' AdamW8bit state (`--to 8bit`), the rest of the file carried, so the loop resumes
    with the 8-bit optimizer from its own file."""
    run_script(tmp_path, GPT_MODEL + textwrap.dedent(f"""
        torch.manual_seed(0)
        model = GPT(d=64)
        named = list(model.named_parameters())
        opt = torch.optim.AdamW([{{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1}},
                                 {{"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}}], lr=1e-3)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            model(torch.randint(0, 40, (4, 8), generator=g)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.save({{"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 3,
                    "model_args": {{"d": 64}}}}, {str(tmp_path / "ckpt.pt")!r})
    """), "make_ckpt.py")
    block = ["--block-size", "64"] if target == "torchao" else []
    proc = optstate_cli("convert", tmp_path / "ckpt.pt", tmp_path / "eight.pt", "--format", target, "--to", "8bit",
                        *block)
    assert "; carried unchanged: ['iter_num'], ['model_args']; kept the model's 1 other tensor (lm_head.weight)" \
        in proc.stdout, proc.stdout
    run_script(tmp_path, GPT_MODEL + textwrap.dedent(f"""
        src = torch.load({str(tmp_path / "ckpt.pt")!r}, weights_only=True)
        if {target!r} == "torchao":
            from torchao.optim import AdamW8bit
            make = lambda groups: AdamW8bit(groups, lr=1e-3, block_size=64)
            ck = torch.load({str(tmp_path / "eight.pt")!r}, weights_only=False)
        else:
            import bitsandbytes as bnb
            make = lambda groups: bnb.optim.AdamW8bit(groups, lr=1e-3)
            ck = torch.load({str(tmp_path / "eight.pt")!r}, weights_only=True)
        assert list(ck) == list(src) and ck["iter_num"] == 3 and ck["model_args"] == {{"d": 64}}
        model = GPT(d=64)
        model.load_state_dict(ck["model"])  # strict: the tied head's name too
        assert all(torch.equal(v, src["model"][k]) for k, v in model.state_dict().items())
        named = list(model.named_parameters())
        opt = make([{{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1}},
                    {{"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}}])
        opt.load_state_dict(ck["optimizer"])
        p = model.h[0].fc.weight  # 256 x 64: 8-bit state
        st = opt.state[p]
        codes = st["exp_avg"].codes if {target!r} == "torchao" else st["state1"]
        assert codes.dtype == torch.uint8, codes.dtype
        g = torch.Generator().manual_seed(3)
        model(torch.randint(0, 40, (4, 8), generator=g)).float().square().mean().backward()
        opt.step()
    """), "resume.py")


# A channels_last conv model under torch's AdamW: torch.save and DCP store the conv weights and
# their moments as they lie in memory (strides of a permutation, not C-contiguous).
MAKE_CHANNELS_LAST = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 4, 3))
    # and a param of 10.5 MB, so a permuted tensor is read in more than one piece of 8 MiB
    model.register_parameter("big", torch.nn.Parameter(torch.randn(160, 64, 16, 16)))
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        x = torch.randn(2, 8, 9, 9, generator=torch.Generator().manual_seed(step))
        (model(x.contiguous(memory_format=torch.channels_last)).square().sum() + model.big.square().sum()).backward()
        opt.step()
        opt.zero_grad()
    assert not opt.state[model[0].weight]["exp_avg"].is_contiguous()
    assert not opt.state[model.big]["exp_avg"].is_contiguous()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out + ".full.pt")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out + ".dcp")
    ref = {}
    for name, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            ref[name + "." + k] = opt.state[p][k].clone()
    torch.save(ref, out + ".full.pt.ref.pt")
    torch.save(ref, out + ".dcp.ref.pt")
""")


def test_channels_last_state_reads_in_logical_order(tmp_path, optstate_cli):
    out = tmp_path / "cl"
    run_script(tmp_path, MAKE_CHANNELS_LAST, "make_cl.py", out)
    full, ck = f"{out}.full.pt", f"{out}.dcp"
    for path in (full, ck):
        proc = optstate_cli("validate", path)
        assert "every chunk checksum verified" in proc.stdout, proc.stdout
        # what torch holds, element by element (torch.equal compares logical order)
        assert_converts_to_ref(optstate_cli, path, tmp_path / (Path(path).name + ".safetensors"), same_keys=False)
    assert hashes(optstate_cli, full) == hashes(optstate_cli, ck)
    # written back as torch.save: torch.load gives the same tensors, now C-contiguous
    optstate_cli("convert", ck, tmp_path / "back.pt", "--format", "torchsave")
    a, b = torch.load(full), torch.load(tmp_path / "back.pt")
    for i, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(b["optimizer"]["state"][i][k], v), (i, k)
    assert all(torch.equal(b["model"][k], v) for k, v in a["model"].items())
    # a damaged byte in a permuted tensor's storage is caught by its CRC-32
    with zipfile.ZipFile(full) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))  # model.big's storage
    raw = bytearray(Path(full).read_bytes())
    h = info.header_offset  # the local header's own name and extra lengths (torch pads with extras)
    at = h + 30 + int.from_bytes(raw[h + 26:h + 28], "little") + int.from_bytes(raw[h + 28:h + 30], "little")
    raw[at + 5] ^= 0x40
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(raw))
    assert "CRC-32" in run_err(optstate_cli, "hash", bad)


def test_optstate_load_restores_the_models_buffers_and_frozen_weights(tmp_path):
    """optstate.load of a {"model", "optimizer"} torch.save file or of a DCP restores what the
    model's load_state_dict would beside the state: BatchNorm's running stats and count (left fresh
    before) and a frozen layer's weights; a buffer of another shape is refused, nothing changed."""
    import optstate
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)

    def make():
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        m[2].requires_grad_(False)  # frozen: not the optimizer's
        return m
    model = make()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for _ in range(3):
        model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    pt, ck = tmp_path / "ck.pt", tmp_path / "ck.dcp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)
    for path, transactional in ((pt, True), (ck, True), (ck, False)):
        fresh = make()
        fused = optstate.FusedAdamW([p for p in fresh.parameters() if p.requires_grad])
        live = fresh[1].running_mean.data_ptr()
        optstate.load(path, fresh, fused, transactional=transactional)
        got = fresh.state_dict()
        for k, v in model.state_dict().items():
            assert torch.equal(got[k], v), (path.name, k)
        assert int(fresh[1].num_batches_tracked) == 3
        assert fresh[1].running_mean.data_ptr() == live  # read in place
        # verify checks them too
        assert optstate.verify(path, fresh, fused) == []
        fresh[1].running_mean[2] += 1
        assert optstate.verify(path, fresh, fused) == [
            f"model tensor '1.running_mean': differs from {path} first at element 2"]
    # A damaged buffer fails the load before anything changes (its CRC-32 checked in the first pass).
    raw = bytearray(pt.read_bytes())
    want = model[1].running_var.detach().numpy().tobytes()
    assert raw.count(want) == 1
    raw[raw.find(want) + 5] ^= 0x40
    (tmp_path / "damaged.pt").write_bytes(bytes(raw))
    fresh = make()
    fused = optstate.FusedAdamW([p for p in fresh.parameters() if p.requires_grad])
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"\['model'\]\['1.running_var'\]: CRC-32 of its storage"):
        optstate.load(tmp_path / "damaged.pt", fresh, fused)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()) and not fused.state
    other = make()
    other[1].running_mean = torch.zeros(5)  # not the checkpoint's model
    before = {k: v.clone() for k, v in other.state_dict().items()}
    fused = optstate.FusedAdamW([p for p in other.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match=r"holds the model's '1.running_mean' of shape \[4\]; the model's is \[5\]"):
        optstate.load(pt, other, fused)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items()) and not fused.state


def test_parameters_in_the_model_dict_and_the_legacy_format(tmp_path, optstate_cli):
    """A model dict saved with keep_vars=True holds nn.Parameters (torch._utils._rebuild_parameter):
    their data are the weights, so the numbered params are named after them as from a plain
    state_dict. A file in torch.save's legacy (non-zip) format is named as such, exit 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(keep_vars=True), "optimizer": opt.state_dict()}, tmp_path / "kv.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "plain.pt")
    insp = json.loads(optstate_cli("inspect", tmp_path / "kv.pt", "--json").stdout)
    assert sorted(insp["params"]) == ["0.bias", "0.weight", "1.bias", "1.weight"] and insp["not_read"] == []
    assert [t["name"] for t in insp["model_tensors"]] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert hashes(optstate_cli, tmp_path / "kv.pt") == hashes(optstate_cli, tmp_path / "plain.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "old.pt",
               _use_new_zipfile_serialization=False)
    err = run_err(optstate_cli, "inspect", tmp_path / "old.pt")
    assert "old.pt: a torch.save file in the legacy format (torch before 1.6, or " \
           "_use_new_zipfile_serialization=False), which optstate does not read" in err, err


def test_a_frozen_weight_optstate_does_not_read_stays_outside_the_model_tensors(tmp_path, optstate_cli):
    """QLoRA keeps its frozen base weights as torchao's NF4Tensor, a subclass optstate does not
    read: in a {"model", "optimizer"} file and in a DCP it is named among what is not read, and a
    DCP converts to a torch.save file without it (the write failed on it when the DCP's model
    items were first taken as the model's other tensors)."""
    import importlib
    nf4 = None
    for module in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor"):
        try:
            nf4 = importlib.import_module(module).to_nf4
            break
        except ImportError:
            continue
    if nf4 is None:
        pytest.skip("no torchao NF4Tensor")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 64, bias=False), torch.nn.Linear(64, 4))
    model[0].weight = torch.nn.Parameter(nf4(model[0].weight.detach()), requires_grad=False)
    opt = torch.optim.AdamW(model[1].parameters())
    model[1](torch.randn(2, 64)).sum().backward()
    opt.step()
    pt, ck = tmp_path / "qlora.pt", tmp_path / "qlora.dcp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)
    for path, line in ((pt, "['model'] (1 entry besides the optimized params' weights)"), (ck, "model (1 item)")):
        insp = json.loads(optstate_cli("inspect", path, "--json").stdout)
        assert insp["model_tensors"] == [] and insp["not_read"] == [line], insp["not_read"]
        assert sorted(insp["params"]) == ["1.bias", "1.weight"]
    err = optstate_cli("convert", ck, tmp_path / "out.pt").stderr
    assert "also holds model (1 item): outside the state read, not in" in err, err
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(got["model"]) == ["1.bias", "1.weight"]


def test_tensor_betas_are_read_as_their_values(tmp_path, optstate_cli):
    """torch.optim.AdamW takes Tensor betas (a compiled step keeps them so a schedule of them does
    not recompile it): a torch.save file of them was refused ("'betas' is not a pair of numbers"),
    and so was a DCP (its betas a bytes item holding the two tensors). Both read the float32
    values the step uses, as the same state; written back they are numbers torch's
    load_state_dict takes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), betas=(torch.tensor(0.9), torch.tensor(0.95)))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    pt, ck = tmp_path / "tb.pt", tmp_path / "tb.dcp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)
    for path in (pt, ck):
        g = json.loads(optstate_cli("inspect", path, "--json").stdout)["param_groups"][0]
        assert g["betas"] == [float(torch.tensor(0.9)), float(torch.tensor(0.95))], g
    assert hashes(optstate_cli, pt) == hashes(optstate_cli, ck)
    optstate_cli("convert", ck, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=1e-3)
    fresh.load_state_dict(back["optimizer"])
    assert fresh.param_groups[0]["betas"] == (float(torch.tensor(0.9)), float(torch.tensor(0.95)))


@pytest.mark.parametrize("cls", ["RAdam", "NAdam"])
def test_radam_and_nadam_state_is_not_taken_for_adamws(tmp_path, optstate_cli, cls):
    """torch.optim.RAdam's state has AdamW's keys (step, exp_avg, exp_avg_sq) and NAdam's too (with
    mu_product): both were read as AdamW's, and a convert handed them to torch.optim.AdamW, whose
    update is another. Refused by their groups (NAdam's momentum_decay; no amsgrad beside torch's
    keys), in a torch.save file and in a DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = getattr(torch.optim, cls)(model.parameters(), lr=1e-3, decoupled_weight_decay=True, weight_decay=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ck.dcp")
    why = "'momentum_decay' is torch.optim.NAdam's group" if cls == "NAdam" else \
        "a torch.optim group with 'foreach' and no 'amsgrad' (RAdam's, NAdam's or Adamax's"
    for path in (tmp_path / "ck.pt", tmp_path / "ck.dcp"):
        err = run_err(optstate_cli, "convert", path, tmp_path / "out.dcp", "--format", "dcp")
        assert "param group 0: " + why in err, err
        assert not (tmp_path / "out.dcp").exists()
    # torch's Adam (decoupled decay) and AdamW still read
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, decoupled_weight_decay=True, weight_decay=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "adam.pt")
    assert json.loads(optstate_cli("inspect", tmp_path / "adam.pt", "--json").stdout)["optimizer"] == "adamw"


@pytest.mark.parametrize("cls,why", [
    ("Muon", "'ns_steps' is torch.optim.Muon's"), ("SGD", "'dampening' is torch.optim.SGD's"),
    ("Adagrad", "'initial_accumulator_value' is torch.optim.Adagrad's"), ("RMSprop", "'centered' is torch.optim.RMSprop's"),
    ("Adadelta", "'rho' is torch.optim.Adadelta's"), ("Adafactor", "'beta2_decay' is torch.optim.Adafactor's"),
    ("Rprop", "'etas' is torch.optim.Rprop's"), ("ASGD", "'t0' is torch.optim.ASGD's")])
def test_another_torch_optimizers_file_is_refused_naming_it(tmp_path, optstate_cli, cls, why):
    """A file of torch's other optimizers (no betas: Muon beside an AdamW for the matrices, SGD, ...)
    is refused naming that optimizer, in a torch.save file and in a DCP, not for a missing field."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False)  # Muon takes matrices only
    kwargs = {"momentum": 0.9} if cls == "SGD" else {}
    opt = getattr(torch.optim, cls)(model.parameters(), lr=1e-3, **kwargs)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ck.dcp")
    for path in (tmp_path / "ck.pt", tmp_path / "ck.dcp"):
        err = run_err(optstate_cli, "inspect", path)
        assert "param group 0: " + why + " group: not AdamW's" in err, err
    # an AdamW group that keeps a key of the same name (its betas tell it) still reads
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.param_groups[0]["t0"] = 100
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "adamw.pt")
    info = json.loads(optstate_cli("inspect", tmp_path / "adamw.pt", "--json").stdout)
    assert info["optimizer"] == "adamw"


@pytest.mark.parametrize("extra,why", [
    ({"grad_averaging": True, "max_grad_norm": 1.0, "bias_correction": True},
     "'grad_averaging' is LAMB's group (a trust ratio scales its update)"),
    ({"caution": True}, "caution=True (timm's cautious AdamW masks the update)"),
    ({"correct_bias": False}, "correct_bias=False (transformers' AdamW without bias correction)"),
    # transformers' optim="galore_adamw": the group galore_torch.GaLoreAdamW is given
    ({"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"},
     "'update_proj_gap' is GaLore's or APOLLO's group (its moments are of the gradient projected to a low rank"),
    # optim="grokadamw": grokadamw.GrokAdamW's defaults
    ({"alpha_init": 0.98, "lamb": 2.0, "gamma": 0.1, "grokking_signal_decay_rate": 0.1, "gradient_clipping": 1.0},
     "'alpha_init' is GrokAdamW's group"),
    # timm 1.0's AdamW: corrected weight decay decays by lr**2 / max_lr (its max_lr_snapshot)
    ({"caution": False, "corrected_weight_decay": True, "max_lr_snapshot": 1e-3},
     "corrected_weight_decay=True (timm's AdamW decays by lr^2 / max_lr, not lr)"),
    # timm 1.0's Adopt (clip_exp, decoupled), as it saves its groups
    ({"clip_exp": 0.333, "decoupled": False, "corrected_weight_decay": False, "max_lr_snapshot": 1e-3, "caution": False},
     "'clip_exp' is ADOPT's group (the gradient normalized by the previous second moment)"),
    # schedulefree 1.4's AdamWScheduleFree (whose state would be z and exp_avg_sq)
    ({"r": 0.0, "k": 2, "warmup_steps": 0, "train_mode": True, "weight_sum": 0.0, "lr_max": 1e-3, "scheduled_lr": 1e-3,
      "weight_lr_power": 2.0}, "'weight_lr_power' is schedule-free AdamW's group")])
def test_adam_kin_whose_updates_are_not_adamws_are_refused(tmp_path, optstate_cli, extra, why):
    """LAMB (apex's FusedLAMB, timm's Lamb), timm's cautious AdamW and its AdamW with corrected weight
    decay, transformers' AdamW without bias correction, GaLore's AdamW, GrokAdamW, ADOPT and
    schedule-free AdamW keep AdamW's moments (GaLore's of the projected gradient, GrokAdamW's of an
    amplified one) or keys under their own group keys: named and refused; the same group keys at
    their AdamW values read."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0].update(extra)
    torch.save(sd, tmp_path / "kin.pt")
    err = run_err(optstate_cli, "inspect", tmp_path / "kin.pt")
    assert "param group 0: " + why in err, err
    if "clip_exp" in extra:
        return
    if "corrected_weight_decay" in extra:  # timm's AdamW as it is by default
        sd["param_groups"][0]["corrected_weight_decay"] = False
        torch.save(sd, tmp_path / "fine.pt")
        optstate_cli("inspect", tmp_path / "fine.pt")
    elif "caution" in extra or "correct_bias" in extra:
        sd["param_groups"][0].update({k: not v for k, v in extra.items()})
        torch.save(sd, tmp_path / "fine.pt")
        optstate_cli("inspect", tmp_path / "fine.pt")


# torchtune's single-device recipes with optimizer_in_bwd: True: an optimizer per param, stepped in
# a post-accumulate-grad hook, saved as OptimizerInBackwardWrapper.state_dict() ({fqn: its
# optimizer's state_dict}) in recipe_state.pt beside the recipe's counters.
MAKE_IN_BACKWARD = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)

    def build(kind):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(128, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 128),
                                    torch.nn.Linear(128, 2))
        if kind == "torchao":
            from torchao.optim import AdamW8bit
            make = lambda p: AdamW8bit([p], lr=1e-2, block_size=64, weight_decay=0.0 if p.dim() == 1 else 0.1)
        elif kind == "bnb":  # torchtune's single-device configs: PagedAdamW8bit, optimizer_in_bwd
            import bitsandbytes as bnb
            make = lambda p: bnb.optim.PagedAdamW8bit([p], lr=1e-2, weight_decay=0.0 if p.dim() == 1 else 0.1)
        else:
            make = lambda p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.0 if p.dim() == 1 else 0.1)
        optims = {p: make(p) for p in model.parameters()}
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4)) for o in optims.values()]

        def hook(p):
            optims[p].step()
            optims[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return model, optims, scheds

    def moments(st):
        if "state1" in st:  # bitsandbytes': its own dequantization
            import bitsandbytes.functional as F
            return {k: st["state" + n] if st["state" + n].dtype != torch.uint8 else F.dequantize_blockwise(
                        st["state" + n], absmax=st["absmax" + n], code=st["qmap" + n], blocksize=256)
                    for k, n in (("exp_avg", "1"), ("exp_avg_sq", "2"))}
        return {k: (v.dequantize() if hasattr(v, "dequantize") else v).clone() for k, v in st.items() if k != "step"}

    def train(model, scheds, steps):
        for step in steps:
            g = torch.Generator().manual_seed(step)
            model[:3](torch.randint(0, 128, (4, 8), generator=g)).square().mean().backward()  # the head unused
            for s in scheds:
                s.step()

    if __name__ == "__main__":
        kind, out = sys.argv[1], sys.argv[2]
        model, optims, scheds = build(kind)
        train(model, scheds, range(3))
        named = {n: optims[p] for n, p in model.named_parameters()}
        torch.save({"optimizer": {n: o.state_dict() for n, o in named.items()}, "seed": 1234, "epochs_run": 0,
                    "total_epochs": 1, "max_steps_per_epoch": None}, out + "/recipe_state.pt")
        torch.save({"model": model.state_dict(),
                    "state": {n: moments(o.state[p]) for (n, o), p in zip(named.items(), model.parameters())},
                    "scheds": [s.state_dict() for s in scheds]}, out + "/ref.pt")
        train(model, scheds, range(3, 5))  # the run unbroken
        torch.save(model.state_dict(), out + "/after.pt")
""")


@pytest.mark.parametrize("kind", ["torch", "torchao", "bnb"])
def test_optimizer_in_backward_reads_by_param_name_and_resumes_from_the_written_file(tmp_path, optstate_cli, kind):
    """Each param's optimizer is read as a group of one param named by its key; converted (and
    torchao's or bitsandbytes' 8-bit moments to torch.optim.AdamW's), the file keeps the wrapper's layout and the
    recipe's counters, so torchtune's own loading resumes from it: each optimizer's state is the
    one saved (dequantized by torchao or bitsandbytes), and torch's per-param run continues bit for
    bit."""
    run_script(tmp_path, MAKE_IN_BACKWARD, "make.py", kind, tmp_path)
    ck = tmp_path / "recipe_state.pt"
    info = json.loads(optstate_cli("inspect", ck, "--json").stdout)
    names = ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
    assert sorted(info["params"]) == sorted(names[:5])  # the unused head's optimizers never stepped
    assert [g["params"] for g in info["param_groups"]] == [1] * 5 + [0] * 2
    assert [info["params"][n]["group"] for n in names[:5]] == list(range(5))
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0, 0.0, 0.1, 0.0, 0.1, 0.0]
    if kind != "torch":
        assert info["params"]["0.weight"]["entries"]["exp_avg"]["encoding"] == "blockwise8"
    # as text, a run of groups alike is one line
    lines = [ln for ln in optstate_cli("inspect", ck, "--no-stats").stdout.splitlines() if ln.startswith("group ")]
    assert [ln.split()[1] for ln in lines] == ["0", "1-2", "3", "4", "5", "6"], lines
    assert lines[1].endswith("(1 params each)") and "weight_decay=0 " in lines[1], lines
    proc = optstate_cli("convert", ck, tmp_path / "plain.pt", "--format", "torchsave")
    assert "carried unchanged: ['seed'], ['epochs_run'], ['total_epochs'], ['max_steps_per_epoch'], 2 params " \
        "without state or weights (never stepped: no shape in the file); kept param groups 0-6 'initial_lr'" \
        in proc.stdout, proc.stdout
    (tmp_path / "resume.py").write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        from make import train
        torch.set_num_threads(1)
        ck = torch.load({str(tmp_path / "plain.pt")!r}, weights_only=True)  # no torchao needed now
        ref = torch.load({str(tmp_path / "ref.pt")!r}, weights_only=True)
        assert [k for k in ck if k != "optimizer"] == ["seed", "epochs_run", "total_epochs", "max_steps_per_epoch"]
        assert ck["seed"] == 1234 and ck["max_steps_per_epoch"] is None
        assert list(ck["optimizer"]) == {names!r}, list(ck["optimizer"])
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(128, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 128),
                                    torch.nn.Linear(128, 2))
        model.load_state_dict(ref["model"])
        optims = {{p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.0 if p.dim() == 1 else 0.1)
                  for p in model.parameters()}}
        for n, p in model.named_parameters():
            optims[p].load_state_dict(ck["optimizer"][n])
            if not ref["state"][n]:  # the unused head's: never stepped, and carried so
                assert not optims[p].state[p] and n.startswith("3."), n
                continue
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(optims[p].state[p][k], ref["state"][n][k]), (n, k)
            assert optims[p].state[p]["step"].item() == 3
            assert optims[p].param_groups[0]["initial_lr"] == 1e-2 or {kind!r} == "torchao"
        # as torchtune rebuilds its scheduler: at the saved step, from each group's initial_lr
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4), last_epoch=2)
                  for o in optims.values()]
        assert all(s.state_dict()["last_epoch"] == saved["last_epoch"] for s, saved in zip(scheds, ref["scheds"]))

        def hook(p):
            optims[p].step()
            optims[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        train(model, scheds, range(3, 5))
        if {kind!r} == "torch":
            after = torch.load({str(tmp_path / "after.pt")!r}, weights_only=True)
            assert all(torch.equal(v, after[k]) for k, v in model.state_dict().items())
    """))
    run_script(tmp_path, (tmp_path / "resume.py").read_text(), "resume.py")
    # The file written back in its own format (torchao's or bitsandbytes', from theirs) is the one
    # torch wrote, key for key.
    optstate_cli("convert", ck, tmp_path / "back.pt", "--format", {"torch": "torchsave", "bnb": "bitsandbytes"}.get(kind, kind))
    run_script(tmp_path, textwrap.dedent(f"""
        import torch

        def same(v, w, where):
            if isinstance(v, dict):
                assert list(v) == list(w), where
                for k in v:
                    same(v[k], w[k], f"{{where}}.{{k}}")
            elif hasattr(v, "codes"):  # torchao's OptimState8bit
                assert torch.equal(v.codes, w.codes) and torch.equal(v.scale, w.scale), where
            elif torch.is_tensor(v):
                assert torch.equal(v, w), where
            else:  # bitsandbytes' step: an int
                assert v == w and type(v) is type(w), where

        a = torch.load({str(ck)!r}, weights_only=False)
        b = torch.load({str(tmp_path / "back.pt")!r}, weights_only=False)
        assert list(a) == list(b) and list(a["optimizer"]) == list(b["optimizer"])
        for n, sd in a["optimizer"].items():
            ga, gb = sd["param_groups"], b["optimizer"][n]["param_groups"]
            assert [{{k: v for k, v in g.items() if k != "lr"}} for g in ga] == \\
                [{{k: v for k, v in g.items() if k != "lr"}} for g in gb], n
            assert all(torch.equal(torch.as_tensor(x["lr"]), torch.as_tensor(y["lr"])) for x, y in zip(ga, gb)), n
            same(sd["state"], b["optimizer"][n]["state"], n)
    """), "back.py")


def test_a_carrying_write_says_what_it_carries_not_how_4bit_moments_were_read(tmp_path, optstate_cli):
    """torchao's AdamW4bit moments are read as fp32 values (no canonical 4-bit form): a write that
    carries the file's other entries carries those, and says the 4-bit encoding is not in DST."""
    sd = torch.load(REPO / "formats/torchsave/testdata/torchao_adamw4bit.pt", weights_only=False)
    torch.save({"optimizer": sd, "seed": 1}, tmp_path / "ck.pt")
    info = json.loads(optstate_cli("inspect", tmp_path / "ck.pt", "--json", "--no-stats").stdout)
    assert info["not_read"][0] == "['seed']" and "4-bit encoding of 0.exp_avg" in info["not_read"][1], info["not_read"]
    proc = optstate_cli("convert", tmp_path / "ck.pt", tmp_path / "out.pt")
    assert proc.stdout.rstrip().endswith("; carried unchanged: ['seed']"), proc.stdout
    assert "also holds torchao's 4-bit encoding of 0.exp_avg" in proc.stderr and "not in" in proc.stderr, proc.stderr
    doc = json.loads(optstate_cli("convert", tmp_path / "ck.pt", tmp_path / "out2.pt", "--json").stdout)
    assert doc["carried"] == ["['seed']"] and "4-bit encoding" in doc["not_carried"][0], doc
    assert torch.load(tmp_path / "out.pt", weights_only=True)["seed"] == 1


def test_a_nan_lr_is_a_finding_kept_where_the_format_holds_it_and_refused_where_not(tmp_path, optstate_cli):
    """A diverged schedule leaves lr NaN: validate says so; torch.save and DCP hold it and read it
    back, and a file equals itself; native, safetensors and HDF5 (JSON metadata: finite numbers
    only) refuse it naming the group, and leave nothing."""
    sd = torch.load(REPO / "formats/torchsave/testdata/torch_adamw_amsgrad.pt", weights_only=True)
    sd["param_groups"][0]["lr"] = float("nan")
    torch.save(sd, tmp_path / "nan.pt")
    proc = optstate_cli("validate", tmp_path / "nan.pt", check=False)
    assert proc.returncode == 1 and "param group 0: lr is nan" in proc.stdout, (proc.stdout, proc.stderr)
    assert "equal within tolerance" in optstate_cli("diff", tmp_path / "nan.pt", tmp_path / "nan.pt").stdout
    optstate_cli("convert", tmp_path / "nan.pt", tmp_path / "dcp", "--format", "dcp")
    optstate_cli("convert", tmp_path / "dcp", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert math.isnan(back["param_groups"][0]["lr"])
    for dst in ("native", "st.safetensors", "h5.h5"):
        err = run_err(optstate_cli, "convert", tmp_path / "nan.pt", tmp_path / dst)
        assert "param group 0: lr is nan: optstate's JSON metadata holds finite numbers only" in err, err
        assert not (tmp_path / dst).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back.pt", "dcp", "nan.pt"]
    # outside what torch.optim.AdamW's constructor takes: findings too
    sd["param_groups"][0].update(lr=1e-3, betas=(0.9, 1.5), weight_decay=-0.1)
    torch.save(sd, tmp_path / "range.pt")
    proc = optstate_cli("validate", tmp_path / "range.pt", check=False)
    assert proc.returncode == 1 and "param group 0: betas[1] is 1.5, outside what torch.optim.AdamW takes " \
        "(0 <= beta < 1)" in proc.stdout and "weight_decay is -0.1" in proc.stdout, proc.stdout


def test_accelerates_optimizer_bin_converts_to_a_bin_of_the_same_kind(tmp_path, optstate_cli):
    """Accelerate's save_state writes torch.save(optimizer.state_dict()) as optimizer.bin: read as any
    torch.save file, and a DST ending in .bin is written as one (not as optstate's folder), which
    accelerator.load_state's torch.load + load_state_dict takes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.bin")
    out = tmp_path / "out" / "optimizer.bin"
    out.parent.mkdir()
    proc = optstate_cli("convert", tmp_path / "optimizer.bin", out)
    assert "(torchsave, 1 rank)" in proc.stdout and out.is_file(), proc.stdout
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(torch.load(out, weights_only=True))
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])


MAKE_MODULE_DCP = textwrap.dedent("""
    # A DCP of a model whose one top-level child is named `module` (Composer's ComposerClassifier
    # wraps its network so): get_state_dict keeps the name, every key begins with 'module.'.
    import sys, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    torch.manual_seed(0)
    model = Wrapper()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.module(torch.randn(3, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=sys.argv[1])
""")


def test_a_torch_save_file_whose_model_keys_all_begin_with_module_says_how_it_reads_back(tmp_path, optstate_cli):
    """Written as torch.save, such a state's model dict has every key under 'module.', which reads
    as DDP's prefix (torch's consume_prefix_in_state_dict_if_present; optstate drops it the same
    way): convert says so, and the file reads back under the names without it, the same state."""
    src = tmp_path / "src"
    run_script(tmp_path, MAKE_MODULE_DCP, "make_module_dcp.py", src)
    names = set(json.loads(optstate_cli("inspect", src, "--json", "--no-stats").stdout)["params"])
    assert names == {"module.0.weight", "module.0.bias", "module.1.weight", "module.1.bias"}, names
    out = tmp_path / "out.pt"
    proc = optstate_cli("convert", src, out)
    assert "every key of its model dict begins with 'module.', which reads as DDP's prefix" in proc.stderr, proc.stderr
    back = set(json.loads(optstate_cli("inspect", out, "--json", "--no-stats").stdout)["params"])
    assert back == {n[len("module."):] for n in names}, back
    # the model dict loads into the model as it was saved (keys kept), and the values are the same
    model_sd = torch.load(out, weights_only=True)["model"]
    assert all(k.startswith("module.") for k in model_sd), sorted(model_sd)
    assert "equal within tolerance" in optstate_cli("diff", src, out, "--by-position").stdout
