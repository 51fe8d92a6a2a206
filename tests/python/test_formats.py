"""Interop of the format drivers with the real tools, on checkpoints made at test time by the venv's
PyTorch and torchao: DCP (single process, 2 FSDP2 ranks over gloo, torchao AdamW8bit), safetensors,
h5py; conversion chains keep the hash; hostile DCP inputs give errors naming the item.
"""
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import forkserver
from launch import run_ranks_past_gloo_aborts


MAKE_DCP = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    kind, out = sys.argv[1], sys.argv[2]
    dist_run = "RANK" in __import__("os").environ
    if dist_run:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    # torchao's compiled step fails on uneven FSDP2 rows (97 over 2 ranks): even ones for it there
    width, out_dim = (128, 4) if dist_run and kind == "ao" else (97, 3)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, out_dim))
    if dist_run:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    if kind == "ao":
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(model.parameters(), lr=1e-3, block_size=64)
    elif kind == "ours8":
        import optstate
        opt = optstate.AdamW8bit(model.parameters(), lr=1e-3, block_size=64)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, amsgrad=(kind == "ams"))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 64, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    if dist_run and kind == "ao":
        # torchao's own dequantize of each rank's OptimState8bit, rows gathered (even shards)
        ref = {}
        for name, p in model.named_parameters():
            ref[name + ".param"] = p.full_tensor().detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                local = opt.state[p][k].to_local()
                local = (local.dequantize() if hasattr(local, "dequantize") else local).contiguous()
                parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, local)
                ref[name + "." + k] = torch.cat(parts)
        if dist.get_rank() == 0:
            torch.save(ref, out + ".ref.pt")
    if not dist_run:
        # What torch/torchao hold, for the comparisons: plain tensors keyed like the canonical names.
        ref = {}
        for name, p in model.named_parameters():
            st = opt.state[p]
            ref[name + ".param"] = p.detach().clone()
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if k in st:
                    v = st[k]
                    ref[name + "." + k] = v.dequantize() if hasattr(v, "dequantize") else v.detach().clone()
                elif k + "_codes" in st:  # optstate's AdamW8bit: plain codes and absmax
                    import optstate
                    qmap = "dynamic-signed" if k == "exp_avg" else "dynamic-unsigned"
                    ref[name + "." + k] = optstate.ops.dequantize_blockwise(
                        st[k + "_codes"], st[k + "_absmax"], 64, qmap).reshape(p.shape)
        torch.save(ref, out + ".ref.pt")
        if kind == "ours8":
            import optstate
            optstate.save(out + ".native", model, opt)
    if dist_run:
        # together (the rare gloo abort in the teardown is retried by the runner)
        dist.barrier()
        dist.destroy_process_group()
""")


def run_script(tmp_path, source, name, *args, ranks=1, distributed=False):
    """Writes `source` to tmp_path/name and runs it with `args`: on `ranks` local ranks (launch.py)
    when ranks > 1 or `distributed` (a script that joins a process group on one rank), else as one
    plain process; a failure fails the test with the script's stderr."""
    script = tmp_path / name
    script.write_text(source)
    cmd = [sys.executable, str(script), *map(str, args)]
    if ranks > 1 or distributed:
        proc = run_ranks_past_gloo_aborts(cmd, ranks)
    else:
        proc = forkserver.run(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def make_dcp(tmp_path, kind, ranks=1):
    out = tmp_path / f"dcp_{kind}_{ranks}"
    run_script(tmp_path, MAKE_DCP, "make_dcp.py", kind, out, ranks=ranks)
    return out


def hashes(cli, path, values=False):
    args = ["hash", path, "--json"] + (["--values"] if values else [])
    import json
    return json.loads(cli(*args).stdout)


def st_load(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def assert_converts_to_ref(cli, ck, dst, *args, same_keys=True):
    """`convert CK DST ARGS` to safetensors gives, bit for bit, the tensors the script that made CK
    saved as CK.ref.pt (what torch / torchao hold, widened to fp32)."""
    cli("convert", ck, dst, *args)
    got = st_load(dst)
    ref = torch.load(str(ck) + ".ref.pt")
    if same_keys:
        assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v.float()), k


@pytest.mark.parametrize("kind", ["fp32", "ams"])
def test_dcp_fp32_reads_exactly_what_torch_holds(tmp_path, optstate_cli, kind):
    ck = make_dcp(tmp_path, kind)
    optstate_cli("validate", ck)
    assert_converts_to_ref(optstate_cli, ck, tmp_path / "x.safetensors")
    # hash of the DCP == hash of its native conversion
    optstate_cli("convert", ck, tmp_path / "native")
    assert hashes(optstate_cli, ck) == hashes(optstate_cli, tmp_path / "native")
    info = optstate_cli("inspect", ck).stdout
    assert f"amsgrad={'true' if kind == 'ams' else 'false'}" in info and "weight_decay=0.05" in info
    if kind == "ams":
        assert "max_exp_avg_sq" in info


LARGE_CARRIED_DCP = textwrap.dedent("""
    # A DCP whose carried values have pickles larger than optstate reads with an archive's first
    # bytes (16 KiB) in archives larger than the last bytes it reads (64 KiB): a run's loss history
    # and a long string.
    import sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).square().sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    extra = {"history": [i / 3 for i in range(30000)], "note": "x" * 70000 + "end", "small": 5}
    dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=sys.argv[1])
""")


def test_dcp_carried_values_of_large_pickles_read_and_convert_unchanged(tmp_path, optstate_cli):
    """Values whose archives pass the bytes read at their ends and whose data.pkl passes the bytes
    read at their start are read where they lie: inspected, hashed, carried DCP -> DCP unchanged."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    src, dst = tmp_path / "src", tmp_path / "dst"
    run_script(tmp_path, LARGE_CARRIED_DCP, "make_large.py", src)
    out = optstate_cli("convert", src, dst, "--format", "dcp")
    assert out.stderr == "" and "extra (3 items)" in out.stdout, out.stdout
    assert hashes(optstate_cli, dst, values=True) == hashes(optstate_cli, src, values=True)
    dcp_to_torch_save(src, tmp_path / "src.pt")
    dcp_to_torch_save(dst, tmp_path / "dst.pt")
    a, b = torch.load(tmp_path / "src.pt", weights_only=False), torch.load(tmp_path / "dst.pt", weights_only=False)
    assert a["extra"]["history"][29999] == 29999 / 3 and a["extra"]["note"].endswith("end")
    assert deep_equal(a, b)


KIN_GROUP_DCP = textwrap.dedent("""
    # torch.optim.AdamW's state saved by dcp.save with extra param-group keys (json in argv[2]), as
    # timm's and transformers' AdamW variants keep them in their groups.
    import json, sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.param_groups[0].update(json.loads(sys.argv[2]))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=sys.argv[1])
""")


@pytest.mark.parametrize("extra,why", [
    ({"caution": True}, "caution=True (timm's cautious AdamW masks the update)"),
    ({"correct_bias": False}, "correct_bias=False (transformers' AdamW without bias correction)"),
    ({"caution": False, "corrected_weight_decay": True, "max_lr_snapshot": 1e-3},
     "corrected_weight_decay=True (timm's AdamW decays by lr^2 / max_lr, not lr)"),
    ({"decoupled_weight_decay": False}, "decoupled_weight_decay=False with weight_decay 0.01: Adam's L2 decay")])
def test_dcp_groups_of_adamw_variants_whose_update_differs_are_refused(tmp_path, optstate_cli, extra, why):
    """The DCP reader reads a group's flags as the torch.save reader does: timm's cautious AdamW and
    its corrected weight decay, transformers' AdamW without bias correction and Adam's L2 decay
    are named and refused; the same keys at AdamW's values read, with the group's lr."""
    run_script(tmp_path, KIN_GROUP_DCP, "make_kin.py", tmp_path / "kin", json.dumps(extra))
    err = run_err(optstate_cli, "inspect", tmp_path / "kin")
    assert "param group 0: " + why in err and str(tmp_path / "kin") in err, err
    assert optstate_cli("validate", tmp_path / "kin", check=False).returncode in (1, 2)
    flag = why.split("=")[0]  # the refused flag at AdamW's value, the other keys kept
    fine = {**extra, flag: not extra[flag]}
    run_script(tmp_path, KIN_GROUP_DCP, "make_kin.py", tmp_path / "fine", json.dumps(fine))
    assert "lr=0.001 " in optstate_cli("inspect", tmp_path / "fine").stdout
    optstate_cli("validate", tmp_path / "fine")


ZSTD_DCP = textwrap.dedent("""
    # The same training saved twice: as torch writes a DCP by default, and through torch's
    # ZStandard extension (each item's bytes one zstd stream); a run's values beside the state.
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.state_dict import get_state_dict
    kind, out = sys.argv[1], sys.argv[2]
    dist_run = "RANK" in os.environ
    if dist_run:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
    if dist_run:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    if kind == "ao":
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(model.parameters(), lr=1e-3, block_size=64)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 64, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "extra": {"history": [i / 3 for i in range(3000)], "step": 3}}
    dcp.save(sd, checkpoint_id=out + "/plain")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(out + "/zstd", _extensions=[ZStandard()]))
    if dist_run:
        dist.barrier()
        dist.destroy_process_group()
""")


def make_zstd_dcp(tmp_path, kind, ranks):
    out = tmp_path / f"zstd_{kind}_{ranks}"
    run_script(tmp_path, ZSTD_DCP, "make_zstd.py", kind, out, ranks=ranks)
    return out / "plain", out / "zstd"


@pytest.mark.parametrize("kind,ranks", [("fp32", 1), ("ao", 2)])
def test_zstd_compressed_dcp_reads_as_the_same_dcp_written_plain(tmp_path, optstate_cli, kind, ranks):
    """torch's ZStandard extension (FileSystemWriter(_extensions=[ZStandard()])) stores each item's
    bytes as a zstd stream: read as the same DCP written plain (state, hash, conversions); DCP -> DCP
    carries the items it does not rewrite as they were stored, compressed, and torch reads it back."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    plain, z = make_zstd_dcp(tmp_path, kind, ranks)
    md = FileSystemReader(str(z)).read_metadata()
    assert {tuple(s.transform_descriptors) for s in md.storage_data.values()} == {("stream.zstd/1",)}
    assert len(list(z.glob("*.distcp"))) == ranks
    assert "every chunk checksum verified" in optstate_cli("validate", z).stdout
    assert hashes(optstate_cli, z, values=True) == hashes(optstate_cli, plain, values=True)
    info = optstate_cli("inspect", z).stdout
    assert info.split("\n", 1)[1] == optstate_cli("inspect", plain).stdout.split("\n", 1)[1]
    assert "extra (2 items)" in info, info
    for src, dst in [(z, "z.safetensors"), (plain, "p.safetensors")]:
        optstate_cli("convert", src, tmp_path / dst)
    assert (tmp_path / "z.safetensors").read_bytes() == (tmp_path / "p.safetensors").read_bytes()
    # DCP -> DCP, both ways of storing: what optstate writes is plain; the items it carries (the
    # run's values, the groups' switches) stay as stored, compressed, their descriptors kept, and
    # torch reads the result as the source.
    out = tmp_path / "zz"
    optstate_cli("convert", z, out, "--format", "dcp", "--to", "fp32")
    md2 = FileSystemReader(str(out)).read_metadata()
    compressed = {i.fqn for i, s in md2.storage_data.items() if s.transform_descriptors}
    assert {"extra.history", "extra.step"} <= compressed, compressed  # and the groups' carried switches
    assert not [k for k in compressed if k.startswith(("optim.state.", "model."))], compressed
    assert hashes(optstate_cli, out) == hashes(optstate_cli, tmp_path / "p.safetensors") or kind == "ao"
    dcp_to_torch_save(str(out), str(tmp_path / "zz.pt"))
    got = torch.load(tmp_path / "zz.pt", weights_only=False)
    assert got["extra"]["history"][2999] == 2999 / 3 and got["extra"]["step"] == 3
    if kind == "fp32":
        dcp_to_torch_save(str(z), str(tmp_path / "z.pt"))
        assert deep_equal(torch.load(tmp_path / "z.pt", weights_only=False), got)


def test_damaged_or_unknown_zstd_items_are_refused_naming_the_item(tmp_path, optstate_cli):
    import shutil
    _, z = make_zstd_dcp(tmp_path, "fp32", 1)
    meta, data = (z / ".metadata").read_bytes(), (z / "__0_0.distcp").read_bytes()
    md = pickle.loads(meta)
    idx = next(i for i in md.storage_data if i.fqn == "optim.state.0.weight.exp_avg")
    loc = md.storage_data[idx]
    bad = tmp_path / "bad"
    shutil.copytree(z, bad)

    def refused(change_md=None, change_data=None, cmd="hash"):
        m = pickle.loads(meta)
        if change_md:
            change_md(m.storage_data[idx])
        d = bytearray(data)
        if change_data:
            change_data(d)
        (bad / ".metadata").write_bytes(pickle.dumps(m))
        (bad / "__0_0.distcp").write_bytes(bytes(d))
        return run_err(optstate_cli, cmd, bad)

    # garbled bytes inside the stream: libzstd's error, or bytes whose torch.save CRC-32 differs
    def garble(d):
        mid = loc.offset + loc.length // 2
        d[mid:mid + 8] = bytes(b ^ 0x5A for b in d[mid:mid + 8])
    err = refused(change_data=garble)
    assert "optim.state.0.weight.exp_avg" in err and ("zstd" in err or "CRC" in err), err
    # a stored length that cuts the stream short: inside a frame
    err = refused(change_md=lambda s: setattr(s, "length", s.length - 7))
    assert "optim.state.0.weight.exp_avg" in err and "ends inside a frame" in err, err
    # one that takes in the first bytes of the next item's: a second frame, cut short
    err = refused(change_md=lambda s: setattr(s, "length", s.length + 40))
    assert "optim.state.0.weight.exp_avg" in err and "ends inside a frame" in err, err
    # transforms optstate does not know, or a version of zstd's it does not: named, before any data
    for desc in ["stream.lz4/1", "stream.zstd/2", "encrypt.aes@corp/1"]:
        err = refused(change_md=lambda s: setattr(s, "transform_descriptors", [desc]), cmd="inspect")
        assert "optim.state.0.weight.exp_avg" in err and f"'{desc}'" in err, err
    # the archive inside in good order but not zstd-stored, while the metadata says so
    def plain_bytes(d):
        d[loc.offset:loc.offset + 4] = b"PK\x03\x04"
    err = refused(change_data=plain_bytes)
    assert "optim.state.0.weight.exp_avg" in err and "zstd" in err, err


def test_dcp_of_two_fsdp2_ranks_equals_the_single_process_state(tmp_path, optstate_cli):
    one = make_dcp(tmp_path, "fp32", 1)
    two = make_dcp(tmp_path, "fp32", 2)
    assert sorted(p for p in os.listdir(two) if p.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    optstate_cli("validate", two)
    # FSDP2 over 2 ranks computes the same training in another reduction order: compare closely,
    # and exactly: the 2-rank DCP read by optstate equals the same DCP read by PyTorch.
    optstate_cli("diff", one, two, "--rtol", "1e-4", "--atol", "1e-6")
    optstate_cli("convert", two, tmp_path / "two.safetensors")
    got = st_load(tmp_path / "two.safetensors")
    import torch.distributed.checkpoint as dcp
    sd = {k: torch.empty_like(v) for k, v in got.items()}
    keyed = {}
    for k in sd:
        fqn, entry = k.rsplit(".", 1)
        keyed[f"model.{fqn}" if entry == "param" else f"optim.state.{fqn}.{entry}"] = sd[k]
    dcp.load(keyed, checkpoint_id=str(two))
    for k in got:
        assert torch.equal(got[k], sd[k]), k
    optstate_cli("convert", two, tmp_path / "n2")
    assert hashes(optstate_cli, two) == hashes(optstate_cli, tmp_path / "n2")


def test_torchao_8bit_dcp_converts_to_torchaos_own_dequantize_bit_for_bit(tmp_path, optstate_cli):
    pytest.importorskip("torchao")
    ck = make_dcp(tmp_path, "ao")
    info = optstate_cli("inspect", ck).stdout
    assert "adamw8bit" in info and "8bit/64 dynamic-signed" in info and "8bit/64 dynamic-unsigned" in info
    assert_converts_to_ref(optstate_cli, ck, tmp_path / "fp32.safetensors", "--to", "fp32", same_keys=False)
    # raw hash of the torchao DCP == its native conversion's (codes and scales kept, not requantized)
    optstate_cli("convert", ck, tmp_path / "native")
    assert hashes(optstate_cli, ck) == hashes(optstate_cli, tmp_path / "native")
    assert hashes(optstate_cli, ck, values=True)["root"] == hashes(optstate_cli, tmp_path / "fp32.safetensors",
                                                                   values=True)["root"]


def test_torchao_8bit_dcp_of_two_fsdp2_ranks_converts_to_torchaos_own_dequantize(tmp_path, optstate_cli):
    """torchtitan's case: torchao AdamW8bit under FSDP2, saved with get_state_dict + dcp.save by 2
    ranks. Each rank's OptimState8bit is a chunk of the item; read without torchao, its codes and
    scales kept (the rows hold whole blocks), and dequantized equal torchao's own, rows gathered."""
    pytest.importorskip("torchao")
    ck = make_dcp(tmp_path, "ao", 2)
    assert sorted(p for p in os.listdir(ck) if p.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    optstate_cli("validate", ck)
    assert "8bit/64 dynamic-signed" in optstate_cli("inspect", ck).stdout
    assert_converts_to_ref(optstate_cli, ck, tmp_path / "fp32.safetensors", "--to", "fp32")
    optstate_cli("convert", ck, tmp_path / "native", "--world-size", "3")
    assert hashes(optstate_cli, ck) == hashes(optstate_cli, tmp_path / "native")


MAKE_TORCHTITAN_DCP = textwrap.dedent("""
    # One training saved twice: as torchtitan's CheckpointManager saves it (model weights at the top
    # level, the optimizer's flattened state dict -- flatten_optimizer_state_dict=True, per-param
    # param_groups fields, no group index -- under "optimizer", and train_state / lr_scheduler /
    # dataloader beside them), and as get_state_dict + dcp.save ({"model", "optim"}, nested).
    import io, os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict)
    kind, out = sys.argv[1], sys.argv[2]
    dist_run = "RANK" in os.environ
    if dist_run:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
    if dist_run:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    groups = [{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
              {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0}]
    if kind == "ao":
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(groups, lr=1e-3, block_size=64)
    elif kind == "ours8":
        import optstate
        opt = optstate.AdamW8bit(groups, lr=1e-3, block_size=64)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.1 * s)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 64, generator=g)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    states = dict(get_model_state_dict(model))
    states["optimizer"] = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    states["lr_scheduler"] = sched.state_dict()
    losses = io.BytesIO()
    torch.save([1.0, 0.5], losses)
    states["train_state"] = {"step": torch.tensor(3, dtype=torch.int32), "global_avg_losses": losses}
    states["dataloader"] = {"dp_rank_0": io.BytesIO(b"opaque")}
    dcp.save(states, checkpoint_id=out)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out + ".nested")
    if dist_run:
        # together (the rare gloo abort in the teardown is retried by the runner)
        dist.barrier()
        dist.destroy_process_group()
""")


@pytest.mark.parametrize("kind,ranks", [("fp32", 1), ("ours8", 1), ("ao", 2)])
def test_torchtitan_layout_dcp_reads_as_the_same_state(tmp_path, optstate_cli, kind, ranks):
    """torchtitan (and zeroband, OLMo-core) save the optimizer with flatten_optimizer_state_dict=True
    and torchtitan puts the weights at the top level: the same state as get_state_dict's nested
    layout, so the same hash; param groups are rebuilt from the per-param fields (equal
    hyperparameters: one group), and the other top-level states are left alone."""
    if kind == "ao":
        pytest.importorskip("torchao")
    out = tmp_path / f"tt_{kind}"
    run_script(tmp_path, MAKE_TORCHTITAN_DCP, "make_tt.py", kind, out, ranks=ranks)
    nested = str(out) + ".nested"
    optstate_cli("validate", out)
    info = optstate_cli("inspect", out).stdout
    assert "2 param group(s)" in info and "weight_decay=0.1" in info and "weight_decay=0 " in info
    if kind != "fp32":
        assert "8bit/64 dynamic-signed" in info
    assert hashes(optstate_cli, out) == hashes(optstate_cli, nested)
    optstate_cli("diff", out, nested, "--rtol", "0", "--atol", "0")
    # what is not optimizer state is named, not silently dropped
    assert "other       dataloader (1 item), lr_scheduler (" in info and "train_state (2 items)" in info
    note = optstate_cli("convert", out, tmp_path / "native").stderr
    assert "also holds dataloader (1 item)" in note and "not in" in note, note
    # its groups' initial_lr (the scheduler's) only: optstate's own format keeps the state alone
    note = optstate_cli("convert", nested, tmp_path / "native2").stderr
    assert note.startswith(f"note: {nested} also holds param groups 0-1 'initial_lr': "
                           "outside the state read") and note.count("\n") == 1, note
    assert hashes(optstate_cli, tmp_path / "native") == hashes(optstate_cli, nested)
    if kind != "fp32":
        return
    # optstate.load matches groups through their params (no group order in a flattened DCP)
    import optstate
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
    with pytest.raises(ValueError, match="split the group"):
        optstate.load(out, model, optstate.FusedAdamW(model.parameters()))
    opt = optstate.FusedAdamW([{"params": [model[0].weight, model[2].weight], "weight_decay": 0.0},
                               {"params": [model[0].bias, model[2].bias], "weight_decay": 0.5}])
    optstate.load(out, model, opt)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert optstate.verify(out, model, opt) == [] and optstate.verify(nested, model, opt) == []
    opt.param_groups[1]["lr"] = 1.0
    assert optstate.verify(out, model, opt) == [
        f"param group 1: hyperparameters of 2 param(s) (first '0.bias') differ from {out}"]


ROTARY_MODEL = textwrap.dedent("""
    import io, sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
        get_optimizer_state_dict, get_state_dict, set_model_state_dict, set_optimizer_state_dict)
    class Rotary(torch.nn.Module):
        # torchtitan's llama keeps its rotary table as a persistent complex64 buffer (freqs_cis);
        # beside it an int16 and a bool buffer, dtypes a model's state dict may hold too.
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(32, 16)
            self.out = torch.nn.Linear(16, 32, bias=False)
            angles = torch.outer(torch.arange(8.0), 1.0 / 10000 ** (torch.arange(0, 8, 2.0) / 8))
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=True)
            self.register_buffer("positions", torch.arange(8, dtype=torch.int16))
            self.register_buffer("keep", torch.tensor([True, False, True, True]))
            # an fp8 base model's frozen weight with its e8m0 block scales (DeepSeek-V3's and MX's
            # layouts), and a uint16 table: dtypes torch pickles as an UntypedStorage (_rebuild_tensor_v3)
            self.register_buffer("base_fp8", torch.linspace(-3, 3, 24).reshape(4, 6).to(torch.float8_e4m3fn))
            self.register_buffer("base_scale", torch.tensor([0.5, 2.0, 4.0, 1.0]).to(torch.float8_e8m0fnu))
            self.register_buffer("vocab_ids", torch.tensor([1, 2, 60000], dtype=torch.int32).to(torch.uint16))
            self.register_buffer("base_fp4", torch.arange(12, dtype=torch.uint8).reshape(2, 6).view(torch.float4_e2m1fn_x2))
        def forward(self, x):
            return self.out(self.tok(x) * self.freqs_cis.real.sum())
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    def torchtitan_states(model, opt):
        states = dict(get_model_state_dict(model))
        states["optimizer"] = get_optimizer_state_dict(model, opt, options=flat)
        states["train_state"] = {"step": torch.tensor(0, dtype=torch.int32)}
        return states
""")

MAKE_ROTARY = ROTARY_MODEL + textwrap.dedent("""
    out = sys.argv[1]
    torch.manual_seed(0)
    model = Rotary()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        model(torch.arange(8) % 32).square().mean().backward()
        opt.step()
        opt.zero_grad()
    states = torchtitan_states(model, opt)
    states["train_state"]["step"] = torch.tensor(2, dtype=torch.int32)
    dcp.save(states, checkpoint_id=out)
    torch.save(model.state_dict(), out + ".model.pt")
""")

RESUME_ROTARY = ROTARY_MODEL + textwrap.dedent("""
    # torchtitan's strict resume of a DCP (every key, the buffers in their dtypes), or a torch.save
    # file's strict model.load_state_dict, then the same model as saved.
    path, kind, saved = sys.argv[1:4]
    model = Rotary()
    for b in model.buffers():
        b.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "dcp":
        states = torchtitan_states(model, opt)
        dcp.load(states, checkpoint_id=path)
        set_model_state_dict(model, {k: v for k, v in states.items() if k not in ("optimizer", "train_state")})
        set_optimizer_state_dict(model, opt, states["optimizer"], options=flat)
        assert states["train_state"]["step"].item() == 2
    else:
        ck = torch.load(path, weights_only=True)
        model.load_state_dict(ck["model"])  # strict
        opt.load_state_dict(ck["optimizer"])
    want = torch.load(saved, weights_only=True)
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():  # float8 has no torch.equal: its bytes
        bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t
        assert got[k].dtype == v.dtype and torch.equal(bits(got[k]), bits(v)), k
    assert all(s["step"].item() == 2 for s in opt.state.values()) and len(opt.state) == 2
""")


def test_torchtitan_rotary_buffer_and_other_dtypes_go_with_the_model(tmp_path, optstate_cli):
    """torchtitan's llama saves its complex64 rotary table (freqs_cis, a persistent buffer) at the
    top level beside the weights: the checkpoint reads (it did not: complex64 was not in the dtype
    table, nor were float8 and uint16, which a frozen fp8 base weight and its scales are), the
    buffer is one of the model's other tensors, DCP -> DCP carries it for torchtitan's
    strict resume on another world size, and a torch.save file written from the DCP holds it (with an
    int16 and a bool buffer) in its model dict, which a strict load_state_dict takes; back to a DCP
    the same."""
    ck = tmp_path / "tt"
    run_script(tmp_path, MAKE_ROTARY, "make_rotary.py", ck)
    saved = f"{ck}.model.pt"
    insp = json.loads(optstate_cli("inspect", ck, "--json").stdout)
    assert sorted(insp["params"]) == ["out.weight", "tok.weight"]
    assert {t["name"]: (t["dtype"], t["shape"]) for t in insp["model_tensors"]} == {
        "freqs_cis": ("c64", [8, 4]), "positions": ("i16", [8]), "keep": ("bool", [4]),
        "base_fp8": ("f8_e4m3fn", [4, 6]), "base_scale": ("f8_e8m0fnu", [4]), "vocab_ids": ("u16", [3]),
        "base_fp4": ("f4_e2m1fn_x2", [2, 6])}
    assert insp["not_read"] == ["train_state (1 item)"]
    optstate_cli("validate", ck)
    optstate_cli("convert", ck, tmp_path / "tt2", "--format", "dcp", "--world-size", "2")
    run_script(tmp_path, RESUME_ROTARY, "resume_rotary.py", tmp_path / "tt2", "dcp", saved)
    out = optstate_cli("convert", ck, tmp_path / "tt.pt").stdout
    assert ("kept the model's 7 other tensors (base_fp4, base_fp8, base_scale, freqs_cis, keep, "
            "positions, 1 more)") in out, out
    run_script(tmp_path, RESUME_ROTARY, "resume_rotary.py", tmp_path / "tt.pt", "torchsave", saved)
    # and the file back to a DCP (get_state_dict's layout): model.<name> items in their dtypes
    optstate_cli("convert", tmp_path / "tt.pt", tmp_path / "back", "--format", "dcp")
    back = json.loads(optstate_cli("inspect", tmp_path / "back", "--json").stdout)
    by_name = lambda tensors: sorted(tensors, key=lambda t: t["name"])
    assert by_name(back["model_tensors"]) == by_name(insp["model_tensors"])
    assert hashes(optstate_cli, tmp_path / "back") == hashes(optstate_cli, ck)


NUMBERED_MODEL = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    def build():
        torch.manual_seed(0)
        # BatchNorm's buffers sit between params of the same shape; two groups as Hugging Face makes
        # them (weights decayed, the rest not); the last bias gets no gradient (no state).
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8),
                                    torch.nn.Linear(8, 3))
        decay = [p for p in model.parameters() if p.dim() > 1]
        rest = [p for p in model.parameters() if p.dim() <= 1]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
        return model, opt
    def state_of(sd):  # everything an optimizer.state_dict() holds, comparable
        return ({k: {e: v.clone() for e, v in st.items()} for k, st in sd["state"].items()},
                [{k: v for k, v in g.items()} for g in sd["param_groups"]])
""")

MAKE_NUMBERED = NUMBERED_MODEL + textwrap.dedent("""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = sys.argv[1]
    model, opt = build()
    for step in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        model[3].bias.grad = None
        opt.step()
        opt.zero_grad()
    assert len(opt.state) == 7
    # optimizer.state_dict() saved as it is (params and state by number), torch's own conversion of
    # such a torch.save file, the optimizer alone, and get_state_dict's named form of the same run
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=f"{out}/numbered")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{out}/ref.pt")
    torch_save_to_dcp(f"{out}/ref.pt", f"{out}/from_torch")
    dcp.save({"optimizer": opt.state_dict()}, checkpoint_id=f"{out}/alone")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/named")
    # A LoRA-like run: of three 8x8 weights only the first and last are trained; which two of the
    # three the optimizer's params are cannot be told from shapes.
    torch.manual_seed(0)
    lora = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(3)])
    lora[1].weight.requires_grad_(False)
    opt = torch.optim.AdamW([lora[0].weight, lora[2].weight], lr=1e-2)
    lora(torch.randn(2, 8)).sum().backward()
    opt.step()
    dcp.save({"model": lora.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=f"{out}/ambiguous")
    # the same optimizer built from named_parameters(): its groups keep param_names beside the numbers
    opt = torch.optim.AdamW([(n, p) for n, p in lora.named_parameters() if p.requires_grad], lr=1e-2)
    lora(torch.randn(2, 8)).sum().backward()
    opt.step()
    dcp.save({"model": lora.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=f"{out}/param_names")
""")

CHECK_NUMBERED = NUMBERED_MODEL + textwrap.dedent("""
    # A DCP written by optstate, resumed as the loop that saved it resumes: a fresh model and AdamW
    # (its state made by a step of zero gradients), dcp.load into {"model": model.state_dict(),
    # "optimizer": opt.state_dict()} (the optimizer's alone where it was saved alone), then
    # load_state_dict of both (strict): the saved state, its groups as the optimizer's.
    path, ref, has_model = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    want = torch.load(ref, weights_only=True)
    ws, wg = state_of(want["optimizer"])
    model, opt = build()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[3].bias.grad = None
    opt.step()
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()} if has_model else {"optimizer": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    if has_model:
        model.load_state_dict(sd["model"])
        got_model = model.state_dict()
        assert got_model.keys() == want["model"].keys()
        assert all(torch.equal(got_model[k], v) for k, v in want["model"].items())
    opt.load_state_dict(sd["optimizer"])
    gs, gg = state_of(opt.state_dict())
    assert [g["params"] for g in gg] == [g["params"] for g in wg] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert sorted(gs) == sorted(ws) == [0, 1, 2, 3, 4, 5, 6], sorted(gs)
    for k in ws:
        assert gs[k].keys() == ws[k].keys() and all(torch.equal(gs[k][e], ws[k][e]) for e in ws[k]), k
    for a, b in zip(gg, wg):
        assert all(a[k] == b[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")), (a, b)
""")




def test_numbered_dcp_of_optimizer_state_dict(tmp_path, optstate_cli):
    """dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}) keys the state by
    param number (`optimizer.state.0.exp_avg`, `params` a list of ints), as does torch's own
    torch_save_to_dcp of a torch.save file: such a DCP did not open ("params is not a list of
    names"). Its params are named after the model's tensors beside them, as a torch.save file's
    (BatchNorm's buffers passed over): it hashes like get_state_dict's DCP of the same run, and DCP
    -> DCP (any world size) writes the numbered layout again, which torch's dcp_to_torch_save reads
    back as the saved state_dict and model; the optimizer alone keeps its numbers (gaps too)."""
    run_script(tmp_path, MAKE_NUMBERED, "make_numbered.py", tmp_path)
    named = hashes(optstate_cli, tmp_path / "named")
    for ck in ("numbered", "from_torch"):
        insp = json.loads(optstate_cli("inspect", tmp_path / ck, "--json").stdout)
        assert sorted(insp["params"]) == [f"{i}.{w}" for i in range(4) for w in ("bias", "weight")], insp["params"]
        assert sorted(t["name"] for t in insp["model_tensors"]) == [
            "1.num_batches_tracked", "1.running_mean", "1.running_var"]
        assert hashes(optstate_cli, tmp_path / ck) == named
        optstate_cli("validate", tmp_path / ck)
        for world in ("1", "2"):
            out = tmp_path / f"{ck}_w{world}"
            optstate_cli("convert", tmp_path / ck, out, "--format", "dcp", "--world-size", world)
            assert hashes(optstate_cli, out) == named
            run_script(tmp_path, CHECK_NUMBERED, "check_numbered.py", out, tmp_path / "ref.pt", 1)
    # optstate.load takes the named state and the model's buffers (BatchNorm's statistics) too.
    import optstate
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 3))
    opt = optstate.FusedAdamW([{"params": [p for p in model.parameters() if p.dim() > 1]},
                               {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}],
                              lr=1e-2)
    optstate.load(tmp_path / "numbered", model, opt)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref["model"].items())
    assert torch.equal(opt.state[model[2].weight]["exp_avg"], ref["optimizer"]["state"][1]["exp_avg"])
    assert optstate.verify(tmp_path / "numbered", model, opt) == []
    # Shapes that fit in more than one way: the params keep their numbers, and inspect says why.
    insp = json.loads(optstate_cli("inspect", tmp_path / "ambiguous", "--json").stdout)
    assert sorted(insp["params"]) == ["0", "1"]
    assert insp["not_read"] == ["model (the model's tensors: the optimizer's 2 params (in 1 group) fit among its 3 "
                                "tensors in more than one way (buffers or frozen params shaped like params); which is "
                                "which cannot be told, so params keep their numbers)"], insp["not_read"]
    # With param_names (an optimizer built from named_parameters()) those name them, and the weights.
    insp = json.loads(optstate_cli("inspect", tmp_path / "param_names", "--json").stdout)
    assert sorted(insp["params"]) == ["0.weight", "2.weight"] and insp["not_read"] == []
    assert [t["name"] for t in insp["model_tensors"]] == ["1.weight"]
    assert insp["params"]["0.weight"]["entries"].keys() >= {"exp_avg", "param"}, insp["params"]["0.weight"]
    # The optimizer alone: nothing names the params, which keep their numbers through DCP -> DCP;
    # param 7 (the bias without state) has no shape there: not read, said so, and listed in its
    # group again when written, so the groups stay the optimizer's.
    insp = json.loads(optstate_cli("inspect", tmp_path / "alone", "--json").stdout)
    assert sorted(insp["params"]) == ["0", "1", "2", "3", "4", "5", "6"]
    assert insp["not_read"] == ["1 param without state or weights (never stepped: no shape in the checkpoint)"]
    optstate_cli("convert", tmp_path / "alone", tmp_path / "alone2", "--format", "dcp", "--world-size", "2")
    run_script(tmp_path, CHECK_NUMBERED, "check_numbered.py", tmp_path / "alone2", tmp_path / "ref.pt", 0)


TOP_LEVEL_OPTIMIZER = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
        set_optimizer_state_dict)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    def train(model, opt, steps):
        for step in range(steps):
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    kind, path = sys.argv[1], sys.argv[2]
    if kind == "make":
        # the optimizer's state dict as the whole DCP: as it is (numbered) and get_optimizer_state_dict's
        model, opt = build(0)
        train(model, opt, 2)
        dcp.save(opt.state_dict(), checkpoint_id=f"{path}/numbered")
        dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=f"{path}/named")
        dcp.save(get_optimizer_state_dict(model, opt, options=flat), checkpoint_id=f"{path}/flat")
        torch.save(opt.state_dict(), f"{path}/ref.pt")
    else:
        # resumed as each was saved, into a fresh model's AdamW: the saved state
        model, opt = build(1)
        train(model, opt, 1)
        if kind == "numbered":
            sd = opt.state_dict()
            dcp.load(sd, checkpoint_id=path)
            opt.load_state_dict(sd)
        else:
            options = flat if kind == "flat" else None
            osd = get_optimizer_state_dict(model, opt, options=options)
            dcp.load(osd, checkpoint_id=path)
            set_optimizer_state_dict(model, opt, osd, options=options)
        got, want = opt.state_dict(), torch.load(sys.argv[3], weights_only=True)
        assert sorted(got["state"]) == sorted(want["state"]) == [0, 1, 2, 3]
        for k, st in want["state"].items():
            assert all(torch.equal(got["state"][k][e], v) for e, v in st.items()), k
""")


def test_dcp_of_the_optimizer_alone_at_the_top_level(tmp_path, optstate_cli):
    """dcp.save(opt.state_dict()) and dcp.save(get_optimizer_state_dict(model, opt)) (flattened or
    not) save the optimizer's state dict as the whole DCP (`state.<fqn>.exp_avg`, `param_groups.0.lr`, under no
    key): such a DCP did not open ("a DCP checkpoint without optimizer state"). Read now, and DCP ->
    DCP on two ranks writes it at the top level again, numbered or named as it was, which the loop's
    own dcp.load takes back as the saved state."""
    run_script(tmp_path, TOP_LEVEL_OPTIMIZER, "top.py", "make", tmp_path)
    numbered = json.loads(optstate_cli("inspect", tmp_path / "numbered", "--json").stdout)
    named = json.loads(optstate_cli("inspect", tmp_path / "named", "--json").stdout)
    assert sorted(numbered["params"]) == ["0", "1", "2", "3"]
    assert sorted(named["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert numbered["not_read"] == named["not_read"] == []
    assert hashes(optstate_cli, tmp_path / "flat") == hashes(optstate_cli, tmp_path / "named")
    for kind in ("numbered", "named", "flat"):
        out = tmp_path / f"{kind}_2"
        optstate_cli("convert", tmp_path / kind, out, "--format", "dcp", "--world-size", "2")
        assert hashes(optstate_cli, out) == hashes(optstate_cli, tmp_path / kind)
        run_script(tmp_path, TOP_LEVEL_OPTIMIZER, "top.py", kind, out, tmp_path / "ref.pt")


MAKE_DDP = textwrap.dedent("""
    # A DDP run (one gloo rank) saved as many scripts save it: the wrapper's own state_dict, every
    # key under 'module.'; as a torch.save file, as a DCP of the optimizer's state_dict as it is, and
    # as get_state_dict's DCP (which drops 'module.').
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for step in range(2):
        ddp(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save({"model": ddp.state_dict(), "optimizer": opt.state_dict()}, f"{out}/ddp.pt")
    dcp.save({"model": ddp.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=f"{out}/ddp_numbered")
    msd, osd = get_state_dict(ddp, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/named")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{out}/ref.pt")
    dist.destroy_process_group()
""")


def test_ddp_wrapped_state_dict_names_drop_module(tmp_path, optstate_cli):
    """ddp.state_dict() puts every key under 'module.'. A torch.save file or a numbered DCP of it
    named its params 'module.0.weight', so optstate.load found no param '0.weight' in the model,
    wrapped or not, and it hashed unlike get_state_dict's DCP of the run. Where every key is under
    'module.' (torch's consume_prefix_in_state_dict_if_present) the names drop it now: the same
    hash as the named DCP, optstate.load into the bare model (buffers too), and a torch.save write
    back into the file's own layout keeps the file's 'module.' keys."""
    import optstate
    run_script(tmp_path, MAKE_DDP, "make_ddp.py", tmp_path, distributed=True)
    named = hashes(optstate_cli, tmp_path / "named")
    for ck in ("ddp.pt", "ddp_numbered"):
        insp = json.loads(optstate_cli("inspect", tmp_path / ck, "--json").stdout)
        assert sorted(insp["params"]) == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"], ck
        assert sorted(t["name"] for t in insp["model_tensors"]) == [
            "1.num_batches_tracked", "1.running_mean", "1.running_var"], ck
        assert hashes(optstate_cli, tmp_path / ck) == named, ck
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
        opt = optstate.FusedAdamW(model.parameters(), lr=1e-2)
        optstate.load(tmp_path / ck, model, opt)
        ref = torch.load(tmp_path / "ref.pt", weights_only=True)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in ref["model"].items()), ck
        assert torch.equal(opt.state[model[2].weight]["exp_avg"], ref["optimizer"]["state"][4]["exp_avg"])
    optstate_cli("convert", tmp_path / "ddp.pt", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert list(back["model"]) == list(torch.load(tmp_path / "ddp.pt", weights_only=True)["model"])
    assert hashes(optstate_cli, tmp_path / "back.pt") == named


FLOAT8_MODEL = textwrap.dedent("""
    # torchao's float8 training (torchtitan's float8 converter) under FSDP2 with float8 all-gather:
    # each weight a WeightWithDynamicFloat8CastTensor (inside the DTensor), which DCP and torch.save
    # pickle as the subclass around the weight's own tensor. No forward: float8 matmuls need a GPU;
    # the gradients are set, the optimizer steps the wrapped weights.
    import os, sys, warnings, logging, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    dist.init_process_group("gloo")
    def build(seed, steps):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            for p in model.parameters():
                p.grad = torch.distributed.tensor.distribute_tensor(
                    torch.randn(p.shape, generator=g), p.device_mesh, p.placements)
            opt.step()
        return model, opt
    def plain(t):
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        return getattr(t, "_tensor", t).detach().clone()
""")

MAKE_FLOAT8 = FLOAT8_MODEL + textwrap.dedent("""
    out = sys.argv[1]
    model, opt = build(0, 2)
    assert type(model[0].weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    ref = {}
    for name, p in model.named_parameters():
        ref[name + ".param"] = plain(p)
        for k in ("exp_avg", "exp_avg_sq"):
            ref[name + "." + k] = plain(opt.state[p][k])
    if dist.get_rank() == 0:
        torch.save(ref, out + ".ref.pt")
    dist.barrier()
    dist.destroy_process_group()
""")

RESUME_FLOAT8 = FLOAT8_MODEL + textwrap.dedent("""
    # the float8 model resumes from PATH (dcp.load + set_state_dict) with the state of REF
    path, ref = sys.argv[1], torch.load(sys.argv[2])
    model, opt = build(1, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    assert type(model[0].weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
    for name, p in model.named_parameters():
        assert torch.equal(plain(p), ref[name + ".param"]), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain(opt.state[p][k]), ref[name + "." + k]), name + "." + k
    dist.barrier()
    dist.destroy_process_group()
""")


def test_torchao_float8_training_weights_read_as_their_own_tensor(tmp_path, optstate_cli):
    """torchtitan's float8 training (torchao's convert_to_float8_training with FSDP2's float8
    all-gather) keeps each weight in a WeightWithDynamicFloat8CastTensor: its DCP did not open
    ("a tensor subclass other than torchao's OptimState8bit ..."). The wrapper's data is the weight
    in its own dtype: read as such, bit for bit what torch holds, and a DCP written back (for another
    world size) resumes the float8 model exactly."""
    pytest.importorskip("torchao")
    ck = tmp_path / "f8"
    run_script(tmp_path, MAKE_FLOAT8, "make_float8.py", ck, ranks=2)
    optstate_cli("validate", ck)
    assert_converts_to_ref(optstate_cli, ck, tmp_path / "f8.safetensors")
    optstate_cli("convert", ck, tmp_path / "f8-1", "--format", "dcp", "--world-size", "1")
    assert hashes(optstate_cli, tmp_path / "f8-1") == hashes(optstate_cli, ck)
    run_script(tmp_path, RESUME_FLOAT8, "resume_float8.py", tmp_path / "f8-1", f"{ck}.ref.pt", ranks=2)


MAKE_PRIME_RL_DCP = textwrap.dedent("""
    # prime-rl's trainer checkpoint: dcp.save({"app": AppState}) where AppState.state_dict() is
    # {"model", "optimizers" (get_state_dict(model, [optimizers]): nested layout), "scheduler",
    # "progress"} -- everything one level down, under "app". The same training is also saved as
    # get_state_dict + dcp.save ({"model", "optim"}), and what torch holds as OUT.ref.pt.
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    out = sys.argv[1]
    dist_run = "RANK" in os.environ
    if dist_run:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 4))
    if dist_run:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.1 * s)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 64, generator=g)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    class AppState(Stateful):
        def state_dict(self):
            msd, osd = get_state_dict(model, [opt])
            return {"model": msd, "optimizers": osd, "scheduler": sched.state_dict(),
                    "progress": {"step": 3, "total_tokens": 4096}}

        def load_state_dict(self, state_dict):
            raise AssertionError("not loaded here")

    dcp.save({"app": AppState()}, checkpoint_id=out)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out + ".nested")
    if dist_run:
        # together (the rare gloo abort in the teardown is retried by the runner)
        dist.barrier()
        dist.destroy_process_group()
""")

RESUME_PRIME_RL = textwrap.dedent("""
    # prime-rl's resume: AppState.load_state_dict through set_state_dict, a strict dcp.load of
    # {"app": ...}; the model, optimizer, scheduler and progress must come back as saved.
    import sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    path, ref = sys.argv[1], sys.argv[2]
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.1 * s)
    progress = {}

    class AppState(Stateful):
        def state_dict(self):
            msd, osd = get_state_dict(model, [opt])
            return {"model": msd, "optimizers": osd, "scheduler": sched.state_dict(),
                    "progress": {"step": 0, "total_tokens": 0}}

        def load_state_dict(self, sd):
            set_state_dict(model, [opt], model_state_dict=sd["model"], optim_state_dict=sd["optimizers"])
            sched.load_state_dict(sd["scheduler"])
            progress.update(sd["progress"])

    dcp.load({"app": AppState()}, checkpoint_id=path)
    want = torch.load(ref)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name + ".param"]), name
        st = opt.state[p]
        assert float(st["step"]) == 3.0, name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], want[name + "." + k]), (name, k)
    assert sched.last_epoch == 3 and progress == {"step": 3, "total_tokens": 4096}, (sched.last_epoch, progress)
    model(torch.randn(8, 64)).square().sum().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
""")


@pytest.mark.parametrize("ranks", [1, 2])
def test_prime_rl_dcp_reads_converts_and_resumes(tmp_path, optstate_cli, ranks):
    """prime-rl saves its trainer as dcp.save({"app": AppState}): the optimizer's state one level
    down (app.optimizers.state.<fqn>.<entry>), the weights at app.model.<fqn>. Read as the same
    state as get_state_dict's layout (same hash); the scheduler and progress are named as not read;
    a DCP converted from it keeps prime-rl's layout and carries them, so prime-rl's own resume (a
    strict dcp.load through set_state_dict) restores every weight, moment and step bit for bit."""
    out = tmp_path / "prime"
    run_script(tmp_path, MAKE_PRIME_RL_DCP, "make_prime.py", out, ranks=ranks)
    nested = str(out) + ".nested"
    optstate_cli("validate", out)
    info = optstate_cli("inspect", out).stdout
    assert "1 param group(s), 4 params" in info and "weight_decay=0.1" in info, info
    assert "other       app.progress (2 items), app.scheduler (" in info, info
    assert hashes(optstate_cli, out) == hashes(optstate_cli, nested)
    optstate_cli("diff", out, nested, "--rtol", "0", "--atol", "0")
    # torch's own values, from the nested copy, as the reference for the resume
    optstate_cli("convert", nested, tmp_path / "ref.safetensors")
    ref = {k: v for k, v in st_load(tmp_path / "ref.safetensors").items() if not k.startswith("__")}
    torch.save(ref, tmp_path / "ref.pt")
    copy = tmp_path / "prime_copy"
    optstate_cli("convert", out, copy, "--format", "dcp")
    assert hashes(optstate_cli, copy) == hashes(optstate_cli, out)
    assert "app.progress (2 items)" in optstate_cli("inspect", copy).stdout
    run_script(tmp_path, RESUME_PRIME_RL, "resume_prime.py", copy, tmp_path / "ref.pt")
    run_script(tmp_path, RESUME_PRIME_RL, "resume_prime.py", out, tmp_path / "ref.pt")  # the check itself
    # optstate's own optimizer resumes from it too (optstate.load reads any DCP layout it reads)
    import optstate
    model = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 4))
    opt = optstate.FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    optstate.load(out, model, opt)
    assert optstate.verify(out, model, opt) == []
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[f"{name}.param"]), name
        assert torch.equal(opt.state[p]["exp_avg"], ref[f"{name}.exp_avg"]), name


MAKE_COMPOSER_DCP = textwrap.dedent("""
    # A checkpoint laid out as Composer's sharded one (state_dict_type="sharded"; Composer itself pins
    # older torch): dcp.save({"state": State.state_dict(), "rng": [...]}), the model's dict under
    # state.model (a ComposerModel keeps the wrapped model as .model), each optimizer under
    # state.optimizers.<its class name>, as get_optimizer_state_dict gives it. The optimizer is
    # Composer's DecoupledAdamW: torch's AdamW with initial_lr in every group and the decay scaled by
    # lr / initial_lr. Saves what it holds as <out>.ref.pt, and torchtitan's nesting of the same
    # state ({"model", "optim"}), with torch.optim.AdamW's equivalent weight decay, as <out>.plain.
    # With "int-lr", lr and so initial_lr are the int 1 (a scheduler copies what it is given).
    import os, random, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    out = sys.argv[1]
    lr = 1 if sys.argv[2:] == ["int-lr"] else 6e-4
    dist_run = "RANK" in os.environ  # Composer's FSDP: each rank saves its shards
    if dist_run:
        dist.init_process_group("gloo")
    class DecoupledAdamW(torch.optim.AdamW):
        def __init__(self, params, lr, weight_decay):
            super().__init__(params, lr=lr, weight_decay=weight_decay)
            for group in self.param_groups:
                group["initial_lr"] = group["lr"]
        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                decay, wd = group["lr"] / group["initial_lr"], group["weight_decay"]
                for p in group["params"]:
                    p.mul_(1 - decay * wd)
                group["weight_decay"] = 0.0
            super().step()
            for group in self.param_groups:
                group["weight_decay"] = wd
    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 4))
        def forward(self, x):
            return self.model(x)
    torch.manual_seed(0)
    model = Wrapped()
    if dist_run:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    opt = DecoupledAdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    for step in range(3):
        model(torch.randn(8, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    state = {"model": msd, "optimizers": {"DecoupledAdamW": osd}, "timestamp": {"epoch": 0, "batch": 3},
             "run_name": "run-1", "rank_zero_seed": 17, "schedulers": {"LambdaLR": {"last_epoch": 3}},
             "algorithms": [], "integrations": {}, "metadata": {"composer_env_info": {"composer_version": "0.32.0"}}}
    dcp.save({"state": state, "rng": [{"python": random.getstate(), "torch": torch.get_rng_state()}]}, checkpoint_id=out)
    plain = {**osd, "param_groups": [{**g, "weight_decay": g["weight_decay"] / g["initial_lr"]} for g in osd["param_groups"]]}
    dcp.save({"model": msd, "optim": plain}, checkpoint_id=out + ".plain")
    full = lambda t: (t.full_tensor() if dist_run else t).detach().clone()
    ref = {}
    for name, p in model.named_parameters():
        ref[name + ".param"] = full(p)
        for k in ("exp_avg", "exp_avg_sq"):
            ref[name + "." + k] = full(opt.state[p][k])
    if not dist_run or dist.get_rank() == 0:
        torch.save(ref, out + ".ref.pt")
    if dist_run:
        dist.barrier()
        dist.destroy_process_group()
""")


@pytest.mark.parametrize("ranks", [1, 2])
def test_composer_sharded_dcp_reads_its_weights_and_converts_both_ways(tmp_path, optstate_cli, ranks):
    """Composer nests its optimizers by class name under its state (state.optimizers.DecoupledAdamW),
    the model beside them (state.model): the weights are found there, not at
    state.optimizers.model. DecoupledAdamW's weight decay is read as torch.optim.AdamW's equivalent
    (divided by initial_lr, as from Composer's torch.save file), so the state reads as the same as a
    plain nesting of it with that decay (same hash), converts to the values it holds and to a
    torch.save file with AdamW's decay, and DCP -> DCP keeps Composer's layout item for item, its
    own decay included."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    src = tmp_path / "composer"
    run_script(tmp_path, MAKE_COMPOSER_DCP, "make_composer.py", src, ranks=ranks)
    info = optstate_cli("inspect", src).stdout
    assert "1 param group(s), 4 params" in info and "model weights" in info, info
    assert "state.model" not in info and "other       rng.0.python (1 item)" in info, info
    assert "weight_decay 1e-05 is Composer's DecoupledAdamW's (not scaled by lr), read as AdamW's 0.01666" in info, info
    assert hashes(optstate_cli, src) == hashes(optstate_cli, str(src) + ".plain")
    assert_converts_to_ref(optstate_cli, src, tmp_path / "state.safetensors")
    optstate_cli("convert", src, tmp_path / "adamw.pt")
    groups = torch.load(tmp_path / "adamw.pt", weights_only=False)["optimizer"]["param_groups"]
    assert groups[0]["weight_decay"] == 1e-5 / 6e-4 and groups[0]["initial_lr"] == 6e-4, groups
    out = optstate_cli("convert", src, tmp_path / "copy", "--format", "dcp")
    assert "Composer's DecoupledAdamW's" in out.stderr, out.stderr
    assert "carried unchanged: rng.0.python (1 item)" in out.stdout and "state.run_name" in out.stdout, out.stdout
    dcp_to_torch_save(src, tmp_path / "src.pt")
    dcp_to_torch_save(tmp_path / "copy", tmp_path / "copy.pt")
    a, b = torch.load(tmp_path / "src.pt", weights_only=False), torch.load(tmp_path / "copy.pt", weights_only=False)
    assert set(a["state"]["model"]) == {"model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"}
    assert deep_equal(a, b)


RESUME_TORCHTITAN = textwrap.dedent("""
    # torchtitan's resume: the state dict it builds (weights at the top level, the flattened
    # optimizer, lr_scheduler, train_state, dataloader), a strict dcp.load, and torch.optim.AdamW --
    # LR_KIND "tensor": built with a tensor lr, as the source came from torchao, whose groups (and so
    # the LR scheduler's state) hold tensors; "float": a float lr; "float-from-tensor": a float lr,
    # the checkpoint's values being torchao's float32 ones (convert --float-lr). Checks the state against EXPECT (our fp32 conversion of the source) and
    # that training goes on; with a second checkpoint, that both resume to bit-equal training.
    import io, sys, torch, torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
        get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
    path, lr_kind, expect = sys.argv[1:4]
    others = ("optimizer", "lr_scheduler", "train_state", "dataloader")
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    def resume(path):
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
        lr = torch.tensor(1e-3) if lr_kind == "tensor" else 1e-3
        opt = torch.optim.AdamW([{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
                                 {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0}],
                                lr=lr, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.1 * s)
        states = dict(get_model_state_dict(model))
        states["optimizer"] = get_optimizer_state_dict(model, opt, options=opts)
        states["lr_scheduler"] = sched.state_dict()
        states["train_state"] = {"step": torch.tensor(0, dtype=torch.int32), "global_avg_losses": io.BytesIO()}
        states["dataloader"] = {"dp_rank_0": io.BytesIO()}
        dcp.load(states, checkpoint_id=path)  # strict: every key above must be in the checkpoint
        set_model_state_dict(model, {k: v for k, v in states.items() if k not in others})
        set_optimizer_state_dict(model, opt, states["optimizer"], options=opts)
        sched.load_state_dict(states["lr_scheduler"])
        return model, opt, sched, states
    model, opt, sched, states = resume(path)
    ref = load_file(expect)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[name + ".param"]), name
        st = opt.state[p]
        assert st["step"].item() == 3, name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], ref[name + "." + k]), name + "." + k
    assert sched.last_epoch == 3
    initial_lr = 1e-3 if lr_kind == "float" else torch.tensor(1e-3)  # as the source's LambdaLR had it
    lr_type = torch.Tensor if lr_kind == "tensor" else float
    assert all(isinstance(g[k], lr_type) for g in opt.param_groups for k in ("lr", "initial_lr"))
    assert all(isinstance(v, lr_type) for v in sched.base_lrs + sched.get_last_lr())
    assert [float(g["lr"]) for g in opt.param_groups] == [float(initial_lr * (1.0 - 0.1 * 3))] * 2
    assert [float(g["initial_lr"]) for g in opt.param_groups] == [float(initial_lr)] * 2
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert states["train_state"]["step"].item() == 3
    assert torch.load(io.BytesIO(states["train_state"]["global_avg_losses"].getvalue())) == [1.0, 0.5]
    assert states["dataloader"]["dp_rank_0"].getvalue() == b"opaque"
    def train(model, opt, sched):
        g = torch.Generator().manual_seed(11)
        model(torch.randn(8, 64, generator=g)).square().sum().backward()
        opt.step()
        sched.step()
    train(model, opt, sched)
    assert opt.state[model[0].weight]["step"].item() == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if len(sys.argv) > 4:
        other = resume(sys.argv[4])
        train(*other[:3])
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other[0].parameters()))
        assert all(torch.equal(opt.state[a]["exp_avg_sq"], other[1].state[b]["exp_avg_sq"])
                   for a, b in zip(model.parameters(), other[0].parameters()))
    print("ok")
""")


def deep_equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, io.BytesIO):
        return isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue()
    return a == b


@pytest.mark.parametrize("kind,ranks", [("fp32", 1), ("ours8", 1), ("ao", 2)])
def test_torchtitan_dcp_converts_to_fp32_in_place_and_torchtitan_resumes_from_it(tmp_path, optstate_cli, kind,
                                                                                   ranks):
    """convert DCP -> DCP keeps the source's layout (the optimizer under "optimizer", flattened,
    weights at the top level, torchao's tensor lr) and carries train_state, lr_scheduler and
    dataloader through byte for byte; torchao's 8-bit moments are dequantized by --to fp32 (else kept:
    the next test). torchtitan resumes from it with torch.optim.AdamW -- a strict
    dcp.load of its whole state dict -- with the state our fp32 conversion holds, its LR schedule,
    step and data position. From torch's own AdamW the result is the source, item for item."""
    if kind == "ao":
        pytest.importorskip("torchao")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    src = tmp_path / f"tt_{kind}"
    run_script(tmp_path, MAKE_TORCHTITAN_DCP, "make_tt.py", kind, src, ranks=ranks)
    dst, expect = tmp_path / "fp32_dcp", tmp_path / "expect.safetensors"
    out = optstate_cli("convert", src, dst, "--format", "dcp", *(["--to", "fp32"] if kind == "ao" else []))
    assert out.stderr == "" and "carried unchanged: dataloader (1 item), lr_scheduler (" in out.stdout, out.stdout
    assert "0 8-bit entries" in out.stdout
    optstate_cli("convert", src, expect, "--to", "fp32")
    assert hashes(optstate_cli, dst, values=True) == hashes(optstate_cli, src, values=True)
    lr_kind = "tensor" if kind == "ao" else "float"
    args = [dst, lr_kind, expect] + ([src] if kind == "fp32" else [])
    run_script(tmp_path, RESUME_TORCHTITAN, "resume_tt.py", *args)
    if kind == "ao":
        # torchtitan builds torch.optim.AdamW with a float lr: --float-lr writes the lrs (groups and
        # the LR scheduler's lists) as floats, so its strict dcp.load finds what it asks for
        out = optstate_cli("convert", src, tmp_path / "float_lr", "--format", "dcp", "--float-lr").stdout
        assert "carried (tensor lrs as floats): dataloader (1 item), lr_scheduler (" in out, out
        run_script(tmp_path, RESUME_TORCHTITAN, "resume_tt.py", tmp_path / "float_lr", "float-from-tensor", expect)
    # torch's own reader of the whole checkpoint (planner_data paths, list indices included)
    dcp_to_torch_save(src, tmp_path / "src.pt")
    dcp_to_torch_save(dst, tmp_path / "dst.pt")
    a, b = torch.load(tmp_path / "src.pt", weights_only=False), torch.load(tmp_path / "dst.pt", weights_only=False)
    for key in ("lr_scheduler", "train_state", "dataloader"):
        assert deep_equal(a[key], b[key]), key
    if kind == "fp32":
        assert deep_equal(a, b)
        # the same for get_state_dict's nested layout ({"model", "optim"}, numbered groups)
        optstate_cli("convert", str(src) + ".nested", tmp_path / "nested_dcp", "--format", "dcp")
        dcp_to_torch_save(str(src) + ".nested", tmp_path / "n_src.pt")
        dcp_to_torch_save(tmp_path / "nested_dcp", tmp_path / "n_dst.pt")
        assert deep_equal(torch.load(tmp_path / "n_src.pt", weights_only=False),
                          torch.load(tmp_path / "n_dst.pt", weights_only=False))
        # a carried item that is not a whole torch.save archive fails the write, naming it; no DST
        from torch.distributed.checkpoint import FileSystemReader
        info = FileSystemReader(str(src)).read_metadata().storage_data
        loc = next(v for k, v in info.items() if k.fqn == "dataloader.dp_rank_0")
        with open(src / loc.relative_path, "r+b") as f:
            f.seek(loc.offset + loc.length - 22)
            f.write(b"\0" * 22)
        bad = optstate_cli("convert", src, tmp_path / "bad", "--format", "dcp", check=False)
        assert bad.returncode == 2 and "item 'dataloader.dp_rank_0'" in bad.stderr, bad.stderr
        assert not (tmp_path / "bad").exists()
        optstate_cli("convert", src, tmp_path / "native")  # the optimizer state itself is intact


RESUME_TORCHAO = textwrap.dedent("""
    # torchtitan's resume with torchao's AdamW8bit (blocks of 64, as MAKE_TORCHTITAN_DCP's), in one
    # process: the state dict it builds, dcp.load, set_state_dict. For each checkpoint given, the
    # state torchao then holds (codes and scales of its OptimState8bit, plain moments, steps) and the
    # weights after one more step. "strict": the whole torchtitan state (LR scheduler, train_state,
    # dataloader) is loaded too; "opt": the weights and the optimizer only (a torch.optim.AdamW
    # source's scheduler keeps float lrs). Prints, as JSON, for each pair of checkpoints whether every
    # tensor is bit for bit equal, the largest difference of the dequantized moments, and whether the
    # checkpoint gave torchao the tensor lr its step needs (a float one is made a tensor to go on).
    import io, json, sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
        get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
    from torchao.optim import AdamW8bit
    mode, paths = sys.argv[1], sys.argv[2:]
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    def resume(path):
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
        opt = AdamW8bit([{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
                         {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0}], lr=1e-3, block_size=64)
        if mode == "strict":  # before the state dict: it gives the groups their initial_lr
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.1 * s)
        states = dict(get_model_state_dict(model))
        states["optimizer"] = get_optimizer_state_dict(model, opt, options=opts)
        if mode == "strict":
            states["lr_scheduler"] = sched.state_dict()
            states["train_state"] = {"step": torch.tensor(0, dtype=torch.int32), "global_avg_losses": io.BytesIO()}
            states["dataloader"] = {"dp_rank_0": io.BytesIO()}
        dcp.load(states, checkpoint_id=path)
        set_model_state_dict(model, {k: v for k, v in states.items() if k not in (
            "optimizer", "lr_scheduler", "train_state", "dataloader")})
        set_optimizer_state_dict(model, opt, states["optimizer"], options=opts)
        if mode == "strict":
            sched.load_state_dict(states["lr_scheduler"])
            assert sched.last_epoch == 3 and states["train_state"]["step"].item() == 3
            assert states["dataloader"]["dp_rank_0"].getvalue() == b"opaque"
        lr_tensor = all(isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)
        for g in opt.param_groups:  # what a float lr needs before torchao steps (its error says so)
            g["lr"] = torch.as_tensor(g["lr"], dtype=torch.float32)
        held = {}
        for name, p in model.named_parameters():
            for k, v in opt.state[p].items():
                held[f"{name}.{k}"] = ("8bit", v.codes.clone(), v.scale.clone(), v.dequantize()) \
                    if hasattr(v, "codes") else ("plain", v.clone())
        assert any(h[0] == "8bit" for h in held.values())
        g = torch.Generator().manual_seed(11)
        model(torch.randn(8, 64, generator=g)).square().sum().backward()
        opt.step()
        if mode == "strict":
            sched.step()
        return held, [p.detach().clone() for p in model.parameters()], lr_tensor
    runs = [resume(p) for p in paths]
    report = []
    for held, params, lr_tensor in runs[1:]:
        ref_held, ref_params, _ = runs[0]
        assert held.keys() == ref_held.keys()
        same = all(a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))
                   for a, b in zip(held.values(), ref_held.values()))
        diff = max(((a[-1] - b[-1]).abs().max() / b[-1].abs().max().clamp(min=1e-30)).item()
                   for a, b in zip(held.values(), ref_held.values()))
        report.append({"state_equal": same, "max_rel_diff": diff, "lr_tensor": lr_tensor,
                       "stepped_equal": all(torch.equal(a, b) for a, b in zip(params, ref_params))})
    print(json.dumps(report))
""")


def resume_torchao(tmp_path, mode, *paths):
    out = run_script(tmp_path, RESUME_TORCHAO, "resume_ao.py", mode, *paths)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torchao_dcp_converted_or_resharded_keeps_torchaos_items_and_torchao_resumes_bit_for_bit(
        tmp_path, optstate_cli):
    """torchtitan with torchao's AdamW8bit, 2 FSDP2 ranks: DCP -> DCP keeps each moment's
    OptimState8bit items (codes and scales as saved, in the source's layout, on 1 or 3 ranks), so
    torchao resumes from optstate's DCP with exactly the state it resumes with from its own, and
    trains on bit for bit. --to fp32 gives torch.optim.AdamW's state instead; torchao requantizes
    that on load (copy_), and blocks whose largest value was negative come back with a smaller
    scale (torchao's signed map has no -1.0): close, not equal."""
    pytest.importorskip("torchao")
    src = tmp_path / "tt_ao"
    run_script(tmp_path, MAKE_TORCHTITAN_DCP, "make_tt.py", "ao", src, ranks=2)
    one, three, plain = tmp_path / "one", tmp_path / "three", tmp_path / "plain"
    out = optstate_cli("convert", src, one, "--format", "dcp").stdout
    assert "2 8-bit entries" in out and "carried unchanged: dataloader (1 item)" in out, out
    assert "2 8-bit entries" in optstate_cli("convert", src, three, "--format", "dcp", "--world-size", "3").stdout
    assert "0 8-bit entries" in optstate_cli("convert", src, plain, "--format", "dcp", "--to", "fp32").stdout
    # codes and scales are the source's: the raw hash is kept
    assert hashes(optstate_cli, one) == hashes(optstate_cli, src) == hashes(optstate_cli, three)
    report = resume_torchao(tmp_path, "strict", src, one, three, plain)
    assert [r["state_equal"] and r["stepped_equal"] and r["lr_tensor"] for r in report[:2]] == [True, True], report
    assert 0 < report[2]["max_rel_diff"] < 0.01, report


def test_torch_adamw_dcp_to_8bit_is_what_torchao_quantizes_on_load(tmp_path, optstate_cli):
    """Switching a torchtitan run from torch.optim.AdamW to torchao's AdamW8bit: `convert --format
    dcp --to 8bit --block-size 64` writes torchao's items, quantized as torchao's own load of the
    fp32 checkpoint quantizes them (copy_ into its OptimState8bit), bit for bit; torchao's step then
    gives the same weights."""
    pytest.importorskip("torchao")
    src = tmp_path / "tt_fp32"
    run_script(tmp_path, MAKE_TORCHTITAN_DCP, "make_tt.py", "fp32", src)
    q = tmp_path / "q8"
    out = optstate_cli("convert", src, q, "--format", "dcp", "--to", "8bit", "--block-size", "64").stdout
    assert "2 8-bit entries" in out, out
    report = resume_torchao(tmp_path, "opt", src, q)
    assert report[0]["state_equal"] and report[0]["stepped_equal"] and report[0]["lr_tensor"], report


def test_flattened_optimizer_state_that_does_not_add_up_is_refused_by_name(tmp_path, optstate_cli):
    import torch.distributed.checkpoint as dcp
    pg = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    st = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}

    def save(name, sd):
        dcp.save(sd, checkpoint_id=str(tmp_path / name))
        return tmp_path / name

    flat = lambda fqns, state_fqns: {**{f"param_groups.{f}.{k}": v for f in fqns for k, v in pg.items()},
                                     **{f"state.{f}.{k}": v.clone() for f in state_fqns for k, v in st.items()}}
    ok = save("ok", {"w": torch.ones(4), "optimizer": flat(["w"], ["w"])})
    assert "1 param group(s)" in optstate_cli("inspect", ok).stdout
    err = run_err(optstate_cli, "inspect", save("no_group", {"optimizer": flat(["w"], ["w", "layers.0.v"])}))
    assert "'layers.0.v'" in err and "param_groups" in err
    err = run_err(optstate_cli, "inspect", save("two", {"optimizer": flat(["w"], ["w"]), "optim": flat(["w"], ["w"])}))
    assert "more than one optimizer state" in err and "'optim'" in err and "'optimizer'" in err
    err = run_err(optstate_cli, "inspect", save("no_lr", {"optimizer": {k: v for k, v in flat(["w"], ["w"]).items()
                                                                        if k != "param_groups.w.lr"}}))
    assert "param_groups of 'w'" in err and "'lr'" in err
    err = run_err(optstate_cli, "inspect", save("no_groups", {"optimizer": flat([], ["w"])}))
    assert "under 'optimizer' without param_groups" in err
    mixed = dict(flat(["w"], ["w"]), param_groups=[dict(pg, params=["w"])])
    err = run_err(optstate_cli, "inspect", save("mixed", {"optimizer": mixed}))
    assert "mixes numbered and flattened" in err
    # diff compares what each param is trained with, not how params are grouped
    other = flat(["w"], ["w"])
    other["param_groups.w.lr"] = 2e-3
    proc = optstate_cli("diff", ok, save("lr", {"w": torch.ones(4), "optimizer": other}), check=False)
    assert proc.returncode == 1 and "hyperparameters of 1 param(s) ('w'): lr 0.001 vs 0.002" in proc.stdout, proc.stdout


MAKE_TP_DCP = textwrap.dedent("""
    # Tensor parallelism (torchtitan's TP dimension) over 2 ranks: ColwiseParallel shards rows
    # (Shard(0)), RowwiseParallel shards columns (Shard(1)) and replicates the bias. "fsdp-tp":
    # torchtitan's 2-D layout on 4 ranks, FSDP2 (fully_shard) over dp=2 on top of TP over tp=2:
    # the colwise weight's rows are then _StridedShard(0, sf=2) over dp and Shard(0) over tp (each
    # rank's rows are not where a plain Shard(0) would put them), the rowwise one Shard(0) x Shard(1).
    # "tp-big": "tp" with a rowwise weight of [20000, 300] (24 MB a tensor), whose column shards'
    # rows take more than one window of a stream and more than one batch of a whole-tensor read.
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out, layout = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2) if layout == "fsdp-tp" else (2,),
                            mesh_dim_names=("dp", "tp") if layout == "fsdp-tp" else ("tp",))
    torch.manual_seed(0)
    hidden, out_features = (300, 20000) if layout == "tp-big" else (40, 6)
    model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, out_features))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if layout == "fsdp-tp":
        from torch.distributed.fsdp import fully_shard
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh["dp"])
        assert "_StridedShard(dim=0, sf=2)" in str(model[0].weight.placements), model[0].weight.placements
        assert str(model[2].weight.placements) == "(Shard(dim=0), Shard(dim=1))", model[2].weight.placements
    else:
        assert str(model[2].weight.placements) == "(Shard(dim=1),)", model[2].weight.placements
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(4, 16, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    ref = {}
    for name, p in model.named_parameters():
        ref[name + ".param"] = p.full_tensor().detach().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            ref[name + "." + k] = opt.state[p][k].full_tensor().clone()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    if dist.get_rank() == 0:
        torch.save(ref, out + ".ref.pt")
    # together (the rare gloo abort in the teardown is retried by the runner)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("layout", ["tp", "fsdp-tp", "tp-big"])
def test_dcp_of_tensor_parallel_ranks_reads_column_shards_exactly(tmp_path, optstate_cli, layout):
    """Column shards (RowwiseParallel's Shard(1)) are n-d chunks whose flat elements are one run per
    row (a strided group of runs a chunk): read without torch, they give torch's own full tensors
    bit for bit. So do torchtitan's 2-D (FSDP2 x TP) ones, _StridedShard rows included: DCP records
    each rank's chunks where they lie. "tp-big": streams in windows that end mid-row, and a
    whole-tensor read (optstate.load) of rows in more than one batch."""
    ck = tmp_path / "tp"
    run_script(tmp_path, MAKE_TP_DCP, "make_tp.py", ck, layout, ranks=4 if layout == "fsdp-tp" else 2)
    # every chunk's rows read in order of its data: each record checked against its CRC-32
    assert json.loads(optstate_cli("validate", ck, "--json").stdout)["checksums_verified"] is True
    assert_converts_to_ref(optstate_cli, ck, tmp_path / "tp.safetensors")
    optstate_cli("convert", ck, tmp_path / "native", "--world-size", "2")
    assert hashes(optstate_cli, ck) == hashes(optstate_cli, tmp_path / "native")
    if layout == "tp-big":
        import optstate
        ref = torch.load(str(ck) + ".ref.pt")
        model = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.GELU(), torch.nn.Linear(300, 20000))
        opt = optstate.FusedAdamW(model.parameters())
        optstate.load(ck, model, opt)
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), ref[name + ".param"]), name
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][k], ref[name + "." + k]), (name, k)


def test_dcp_of_optstate_adamw8bit_is_read_as_its_8bit_state(tmp_path, optstate_cli):
    """get_state_dict + dcp.save of optstate's own AdamW8bit: its state is plain tensors
    (`exp_avg_codes`, `exp_avg_absmax`, ...; block size and maps in the param group), read back as
    blockwise8 entries: the DCP hashes like optstate.save of the same state, converts to the
    dequantized moments, and optstate.load resumes from it with the same codes."""
    import optstate
    ck = make_dcp(tmp_path, "ours8")
    info = optstate_cli("inspect", ck).stdout
    assert "adamw8bit" in info and "8bit/64 dynamic-signed" in info and "8bit/64 dynamic-unsigned" in info
    assert hashes(optstate_cli, ck) == hashes(optstate_cli, str(ck) + ".native")
    assert_converts_to_ref(optstate_cli, ck, tmp_path / "fp32.safetensors", "--to", "fp32")
    model = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 3))
    opt = optstate.AdamW8bit(model.parameters(), block_size=64)
    optstate.load(ck, model, opt)
    assert optstate.verify(str(ck) + ".native", model, opt) == []


def test_dcp_8bit_codes_without_their_layout_are_refused_by_name(tmp_path, optstate_cli):
    import torch.distributed.checkpoint as dcp

    def save(name, state, group):
        out = tmp_path / name
        group = dict(dict(lr=1e-3, betas=(0.9, 0.999), params=["w"]), **group)
        dcp.save({"optim": {"state": {"w": dict(step=torch.tensor(1.0), **state)}, "param_groups": [group]}},
                 checkpoint_id=str(out))
        return out

    codes, absmax = torch.zeros(512, dtype=torch.uint8), torch.ones(2)
    err = run_err(optstate_cli, "inspect", save("no_absmax", {"exp_avg_codes": codes}, {"block_size": 256}))
    assert "exp_avg_codes" in err and "exp_avg_absmax" in err
    err = run_err(optstate_cli, "inspect", save("no_block", {"exp_avg_codes": codes, "exp_avg_absmax": absmax}, {}))
    assert "optim.state.w.exp_avg_codes" in err and "block_size" in err
    err = run_err(optstate_cli, "inspect", save("miscounted", {"exp_avg_codes": codes, "exp_avg_absmax": absmax},
                                                {"block_size": 64}))
    assert "optim.state.w.exp_avg_absmax" in err and "2 scales for 512 codes" in err
    # AdamW keeps both moments; one alone is another optimizer's state (or a damaged one).
    err = run_err(optstate_cli, "inspect", save("one_moment", {"exp_avg_codes": codes, "exp_avg_absmax": absmax},
                                                {"block_size": 256}))
    assert "param 'w'" in err and "no 'exp_avg_sq'" in err
    ok = save("ok", {"exp_avg_codes": codes, "exp_avg_absmax": absmax, "exp_avg_sq": torch.zeros(512)},
              {"block_size": 256})
    assert "8bit/256 dynamic-signed" in optstate_cli("inspect", ok).stdout
    # Per-param state the canonical state has no place for is named, never dropped unsaid.
    extra = save("extra", {"exp_avg": torch.zeros(512), "exp_avg_sq": torch.zeros(512), "gnorm_vec": torch.ones(100)}, {})
    assert json.loads(optstate_cli("inspect", extra, "--json").stdout)["not_read"] == ["optim.state.*.gnorm_vec (1 item)"]
    # State of a param no group lists.
    orphan = tmp_path / "orphan"
    dcp.save({"optim": {"state": {"w": dict(step=torch.tensor(1.0), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4)),
                                  "v": dict(step=torch.tensor(1.0), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4))},
                        "param_groups": [dict(lr=1e-3, betas=(0.9, 0.999), params=["w"])]}}, checkpoint_id=str(orphan))
    assert "param 'v' has state but no param group lists it" in run_err(optstate_cli, "inspect", orphan)
    # State without exp_avg (a misnamed moment, a step alone) is refused, not passed over: a DCP -> DCP
    # write carried such items as the state of a param its groups no longer listed (libFuzzer found it).
    for name, state in (("no_first", {"exp_avg_sq": torch.zeros(512), "exp_avg_2": torch.zeros(512)}),
                        ("step_only", {})):
        err = run_err(optstate_cli, "convert", save(name, state, {}), tmp_path / (name + ".out"), "--format", "dcp")
        assert "param 'w': state (" in err and "without 'exp_avg'" in err, err
        assert not (tmp_path / (name + ".out")).exists()


def test_chain_native_hdf5_safetensors_dcp_native_keeps_the_hash(tmp_path, optstate_cli):
    ck = make_dcp(tmp_path, "fp32")
    optstate_cli("convert", ck, tmp_path / "a")
    optstate_cli("convert", tmp_path / "a", tmp_path / "b.h5", "--compress", "4")
    optstate_cli("convert", tmp_path / "b.h5", tmp_path / "c.safetensors")
    optstate_cli("convert", tmp_path / "c.safetensors", tmp_path / "d", "--format", "dcp")
    optstate_cli("convert", tmp_path / "d", tmp_path / "e")
    want = hashes(optstate_cli, tmp_path / "a")
    for p in ("b.h5", "c.safetensors", "d", "e"):
        assert hashes(optstate_cli, tmp_path / p) == want, p
    # 8-bit: raw hash through native/hdf5/safetensors; DCP stores dequantized moments (values hash)
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "q.h5")
    optstate_cli("convert", tmp_path / "q.h5", tmp_path / "q.safetensors")
    assert hashes(optstate_cli, tmp_path / "q.safetensors") == hashes(optstate_cli, ao)
    optstate_cli("convert", tmp_path / "q.safetensors", tmp_path / "q_dcp", "--format", "dcp")
    assert hashes(optstate_cli, tmp_path / "q_dcp", values=True)["root"] == hashes(optstate_cli, ao, values=True)["root"]
    optstate_cli("convert", tmp_path / "q_dcp", tmp_path / "q_back", "--to", "8bit", "--block-size", "64")
    assert hashes(optstate_cli, tmp_path / "q_back")["entries"] == hashes(optstate_cli, ao)["entries"]


def test_our_dcp_loads_into_torch_adamw_and_training_continues(tmp_path, optstate_cli):
    ck = make_dcp(tmp_path, "fp32")
    optstate_cli("convert", ck, tmp_path / "ours", "--format", "dcp")
    optstate_cli("convert", ck, tmp_path / "ours3", "--format", "dcp", "--world-size", "3")
    assert sorted(p for p in os.listdir(tmp_path / "ours3") if p.endswith(".distcp")) == \
        ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert hashes(optstate_cli, tmp_path / "ours3") == hashes(optstate_cli, ck)
    script = textwrap.dedent(f"""
        import torch, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        def fresh(path):
            torch.manual_seed(123)
            m = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 3))
            o = torch.optim.AdamW(m.parameters(), lr=0.5)
            msd, osd = get_state_dict(m, o)
            sd = {{"model": msd, "optim": osd}}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            return m, o
        a, oa = fresh({str(ck)!r})
        b, ob = fresh({str(tmp_path / "ours")!r})
        c, oc = fresh({str(tmp_path / "ours3")!r})  # 3 ranks' row chunks, resharded by torch onto 1
        assert ob.param_groups[0]["lr"] == 1e-3 and ob.param_groups[0]["weight_decay"] == 0.05
        for m, o in ((a, oa), (b, ob), (c, oc)):
            g = torch.Generator().manual_seed(9)
            m(torch.randn(8, 64, generator=g)).square().sum().backward()
            o.step()
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
        assert ob.state[b[0].weight]["step"].item() == 4
        print("ok")
    """)
    proc = forkserver.run([sys.executable, "-c", script], timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_h5py_and_safetensors_read_ours_and_see_what_it_holds(tmp_path, optstate_cli):
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5", "--compress", "6")
    with h5py.File(tmp_path / "s.h5") as f:
        assert f.attrs["format"] == b"optstate-hdf5" and f.attrs["optimizer"] == b"adamw8bit"
        g = f["0.weight"]
        assert list(g.attrs["shape"]) == [97, 64] and int(g.attrs["step"]) == 3
        assert g["exp_avg"].attrs["encoding"] == b"blockwise8" and int(g["exp_avg"].attrs["block_size"]) == 64
        codes = g["exp_avg"]["codes"]
        assert codes.shape == (97, 64) and codes.dtype.name == "uint8" and codes.fletcher32 and codes.compression == "gzip"
        assert g["exp_avg"]["absmax"].shape == (97,)
        assert f["0.bias"]["exp_avg"].dtype.name == "float32"
        # No clock in the file (the same state writes the same bytes): HDF5 records an object's
        # times unless told not to, and h5py reads them as 0 when absent.
        for obj in (f, g, g["exp_avg"], codes, f["0.bias"]["exp_avg"]):
            assert h5py.h5g.get_objinfo(obj.id).mtime == 0, obj.name
    optstate_cli("convert", ao, tmp_path / "s.safetensors")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        meta = f.metadata()
        assert '"kind":"adamw8bit"' in meta["optstate"]
        assert f.get_tensor("0.weight.exp_avg.codes").dtype == torch.uint8
        assert f.get_tensor("0.weight.exp_avg.absmax").shape == (97,)


def test_hdf5_edited_with_h5py_names_the_missing_dataset(tmp_path, optstate_cli):
    """The reader looks each param's group up once and its datasets relative to it: a dataset, an
    8-bit component or a whole param's group taken away, or a group where a dataset goes, is an
    error naming the dataset."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    edits = {
        "dense": (lambda f: f["0.bias"].__delitem__("exp_avg"), "dataset '/0.bias/exp_avg' is missing"),
        "codes": (lambda f: f["0.weight"]["exp_avg"].__delitem__("codes"), "dataset '/0.weight/exp_avg/codes' is missing"),
        "8-bit group": (lambda f: f["0.weight"].__delitem__("exp_avg_sq"), "dataset '/0.weight/exp_avg_sq/codes' is missing"),
        "param": (lambda f: f.__delitem__("0.bias"), "dataset '/0.bias/"),
        "group for dataset": (lambda f: (f["0.bias"].__delitem__("exp_avg"), f["0.bias"].create_group("exp_avg")),
                              "'/0.bias/exp_avg' is not a dataset"),
    }
    for name, (edit, want) in edits.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.h5"
        shutil.copy(tmp_path / "s.h5", bad)
        with h5py.File(bad, "r+") as f:
            edit(f)
        err = run_err(optstate_cli, "inspect", bad)
        assert want in err and str(bad) in err, (name, err)
        assert optstate_cli("validate", bad, check=False).returncode in (1, 2)


def test_hdf5_metadata_rewritten_by_h5py_reads_as_written(tmp_path, optstate_cli):
    """h5py stores a Python str attribute as a variable-length UTF-8 string (optstate writes fixed-
    length ASCII; libhdf5 converts no string between the two character sets): a learning rate
    edited through h5py is read, hashed and carried on; the same text rewritten as fixed-length
    UTF-8 and the format tag as variable-length read as the file did before."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    before = json.loads(optstate_cli("hash", "--json", tmp_path / "s.h5").stdout)

    edited = tmp_path / "lr.h5"
    shutil.copy(tmp_path / "s.h5", edited)
    with h5py.File(edited, "r+") as f:
        meta = json.loads(f.attrs["optstate"])
        meta["param_groups"][0]["lr"] = 0.5
        f.attrs["optstate"] = json.dumps(meta)
        t = f.attrs.get_id("optstate").get_type()
        assert t.is_variable_str() and t.get_cset() == h5py.h5t.CSET_UTF8
    assert "lr=0.5 " in optstate_cli("inspect", edited).stdout
    optstate_cli("validate", edited)
    after = json.loads(optstate_cli("hash", "--json", edited).stdout)
    # an entry's hash takes its group's hyperparameters (docs/hash.md); the file has one group
    assert after["root"] != before["root"] and after["entries"].keys() == before["entries"].keys()
    assert all(after["entries"][k] != v for k, v in before["entries"].items())
    optstate_cli("convert", edited, tmp_path / "lr.pt", "--format", "torchsave")
    assert torch.load(tmp_path / "lr.pt", weights_only=True)["optimizer"]["param_groups"][0]["lr"] == 0.5

    retyped = tmp_path / "retyped.h5"
    shutil.copy(tmp_path / "s.h5", retyped)
    with h5py.File(retyped, "r+") as f:
        text = f.attrs["optstate"]
        f.attrs.create("optstate", text, dtype=h5py.string_dtype("utf-8", len(text)))
        f.attrs["format"] = "optstate-hdf5"
        assert not f.attrs.get_id("optstate").get_type().is_variable_str()
        assert f.attrs.get_id("format").get_type().is_variable_str()
    assert json.loads(optstate_cli("hash", "--json", retyped).stdout) == before


def test_hdf5_dataset_rewritten_without_fletcher32_is_read_and_validate_says_so(tmp_path, optstate_cli):
    """A dataset h5py writes anew is contiguous with no checksum: the file still reads as the same
    state, and validate, which verified every other dataset's fletcher32, names how many datasets
    have none and the first, instead of claiming every chunk checked."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    report = json.loads(optstate_cli("validate", "--json", tmp_path / "s.h5").stdout)
    assert report["checksums_verified"] is True and report["unchecked"] is None
    edited = tmp_path / "rewritten.h5"
    shutil.copy(tmp_path / "s.h5", edited)
    with h5py.File(edited, "r+") as f:
        values = f["0.bias/exp_avg"][...]
        del f["0.bias/exp_avg"]
        f["0.bias/exp_avg"] = values
        assert f["0.bias/exp_avg"].fletcher32 is False
        total = sum(isinstance(o, h5py.Dataset) for o in iter_objects(f))
    assert hashes(optstate_cli, edited) == hashes(optstate_cli, tmp_path / "s.h5")
    out = optstate_cli("validate", edited).stdout
    assert f"1 of {total} datasets has no fletcher32 checksum, the first '/0.bias/exp_avg' (sizes," in out, out
    report = json.loads(optstate_cli("validate", "--json", edited).stdout)
    assert report["ok"] and report["checksums_verified"] is False and "'/0.bias/exp_avg'" in report["unchecked"]


def rebuild_with_h5py(h5py, src, dst, libver, extra_root_attrs=0, unit_chunks=False, filters=False, **file_options):
    """What a user's h5py script makes of an optstate HDF5 file: every group, dataset (chunks and
    fletcher32 kept, or chunks of one element, or with `filters` resizable, shuffled and
    gzip-compressed with a fill value) and attribute copied into a new file of `libver` (and
    h5py.File's `file_options`), str attributes stored as h5py stores them (variable-length UTF-8
    in the file's global heap)."""
    with h5py.File(src, "r") as s, h5py.File(dst, "w", libver=libver, **file_options) as d:
        def copy_attrs(a, b):
            for k, v in a.attrs.items():
                b.attrs[k] = v.decode() if isinstance(v, bytes) else v

        def visit(name, obj):
            if isinstance(obj, h5py.Group):
                copy_attrs(obj, d.require_group(name))
            else:
                chunks = (1,) * obj.ndim if unit_chunks and obj.ndim else obj.chunks
                extra = {}
                if filters and obj.ndim:
                    # One unlimited dimension or all: under v110 an extensible array or a B-tree v2 indexes the chunks.
                    extra = dict(maxshape=(None,) * obj.ndim if obj.ndim > 1 and name.endswith("codes")
                                 else (None,) + obj.shape[1:], compression="gzip", shuffle=True,
                                 fillvalue=obj.dtype.type(0))
                copy_attrs(obj, d.create_dataset(name, data=obj[...], chunks=chunks, fletcher32=obj.fletcher32,
                                                 **extra))
        copy_attrs(s, d)
        s.visititems(visit)
        for i in range(extra_root_attrs):
            d.attrs[f"note{i}"] = f"a note {i}"
        assert d.attrs.get_id("optstate").get_type().is_variable_str()


def test_hdf5_rebuilt_by_h5py_in_its_file_formats(tmp_path, optstate_cli):
    """h5py's default libver='earliest' (superblock 0, version 1 object headers) reads as the same
    state, the global heap walk before each variable-length attribute read included; so does a root
    with more attributes than compact storage holds (libver='v110': libhdf5 moves them into a fractal
    heap, where the walk does not look: read as libhdf5 reads it), one rechunked into one-element
    chunks, and roots given attributes of every datatype class h5py writes. libver='latest' under
    HDF5 2.0 writes layout messages libhdf5 1.10 does not know: refused naming the dataset and
    libhdf5's cause."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    rebuild_with_h5py(h5py, tmp_path / "s.h5", tmp_path / "earliest.h5", "earliest")
    assert open(tmp_path / "earliest.h5", "rb").read(9)[8] == 0  # superblock version 0
    assert hashes(optstate_cli, tmp_path / "earliest.h5", values=True) == want
    optstate_cli("validate", tmp_path / "earliest.h5")
    rebuild_with_h5py(h5py, tmp_path / "s.h5", tmp_path / "dense.h5", "v110", extra_root_attrs=12)
    assert b"FRHP" in (tmp_path / "dense.h5").read_bytes()  # the attributes' fractal heap
    assert hashes(optstate_cli, tmp_path / "dense.h5", values=True) == want
    # Chunks of one element: every read looks up each chunk it covers (a chunk stored in fewer bytes
    # than its fletcher32 checksum is refused before libhdf5 reads it).
    rebuild_with_h5py(h5py, tmp_path / "s.h5", tmp_path / "unit_chunks.h5", "earliest", unit_chunks=True)
    with h5py.File(tmp_path / "unit_chunks.h5", "r") as f:
        assert f["0.weight/exp_avg/codes"].chunks == (1, 1) and f["0.weight/exp_avg/codes"].id.get_num_chunks() > 100
    assert hashes(optstate_cli, tmp_path / "unit_chunks.h5", values=True) == want
    optstate_cli("validate", tmp_path / "unit_chunks.h5")
    # Root attributes of every datatype class h5py writes (a bool is an enumeration, a complex
    # number a compound): each one's datatype is checked to lie inside its message before libhdf5
    # decodes it; four at a time, so that a v110 root keeps them in its header (compact storage).
    import numpy as np
    nested = np.dtype([("x", "<i2"), ("y", [("p", "<f4"), ("q", "u1")])])
    typed = [{"flag": np.bool_(True), "pair": np.array((1, 2.5), dtype=[("a", "<i4"), ("b", "<f8")]),
              "nested": np.zeros((), dtype=nested), "blob": np.void(b"\x01\x02\x03")},
             {"cells": np.ones((1,), dtype="(2,3)f4"), "cplx": np.complex64(1 + 2j),
              "colour": np.array(1, dtype=h5py.enum_dtype({"RED": 0, "GREEN": 1, "BLUE": 42}, basetype="u1")),
              "ragged": np.array([np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32)],
                                 dtype=h5py.vlen_dtype(np.int32))}]
    for libver in ("earliest", "v110"):
        for i, attrs in enumerate(typed):
            path = tmp_path / f"typed_{libver}_{i}.h5"
            rebuild_with_h5py(h5py, tmp_path / "s.h5", path, libver)
            with h5py.File(path, "r+") as f:
                f.attrs.update(attrs)
            assert b"FRHP" not in path.read_bytes(), libver  # compact: the check reads them
            assert hashes(optstate_cli, path, values=True) == want
    # Datasets that h5py's users compress: filter pipelines (versions 1 and 2) with gzip and shuffle,
    # fill values, chunk indexes of each kind v110 writes; their header messages are checked before
    # libhdf5 decodes them.
    for libver in ("earliest", "v110"):
        path = tmp_path / f"gzip_{libver}.h5"
        rebuild_with_h5py(h5py, tmp_path / "s.h5", path, libver, filters=True)
        with h5py.File(path, "r") as f:
            assert f["0.weight/exp_avg/codes"].compression == "gzip" and f["0.weight/exp_avg/codes"].shuffle
        assert hashes(optstate_cli, path, values=True) == want
        optstate_cli("validate", path)
    # Scale-offset (h5py's scaleoffset=), which libhdf5 1.10 decompresses unbounded: refused naming
    # the dataset, before libhdf5 opens it.
    scaled = tmp_path / "scaleoffset.h5"
    shutil.copy(tmp_path / "s.h5", scaled)
    with h5py.File(scaled, "r+") as f:
        values = f["0.bias/exp_avg"][...]
        del f["0.bias/exp_avg"]
        f.create_dataset("0.bias/exp_avg", data=values, scaleoffset=6)
    err = run_err(optstate_cli, "inspect", scaled)
    assert "dataset '/0.bias/exp_avg'" in err and "(scale-offset), whose decompression libhdf5" in err, err
    # Datasets h5py rewrites compact (their bytes in their headers) read the same.
    compact = tmp_path / "compact.h5"
    shutil.copy(tmp_path / "s.h5", compact)
    with h5py.File(compact, "r+") as f:
        values = f["0.bias/exp_avg"][...]
        del f["0.bias/exp_avg"]
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        f.create_dataset("0.bias/exp_avg", data=values, dcpl=dcpl)
        assert f["0.bias/exp_avg"].id.get_create_plist().get_layout() == h5py.h5d.COMPACT
    assert hashes(optstate_cli, compact, values=True) == want
    rebuild_with_h5py(h5py, tmp_path / "s.h5", tmp_path / "latest.h5", "latest")
    if h5py.version.hdf5_version_tuple >= (2, 0, 0):
        err = run_err(optstate_cli, "inspect", tmp_path / "latest.h5")
        assert "is not a dataset libhdf5" in err and "bad version number for layout message" in err, err
        assert "a newer HDF5's file format" in err and str(tmp_path / "latest.h5") in err
    else:
        assert hashes(optstate_cli, tmp_path / "latest.h5", values=True) == want


def superblock_extension_messages(data):
    """(type, offset, size) of each message in the first chunk of the superblock extension of a
    file with superblock 2-3 at offset 0 and 8-byte addresses (its object header: version 2)."""
    assert data[8] in (2, 3) and data[9] == 8
    at = int.from_bytes(data[20:28], "little")
    assert data[at:at + 5] == b"OHDR\x02"
    flags = data[at + 5]
    p = at + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 3)
    end = p + width + int.from_bytes(data[p:p + width], "little")
    p += width
    messages = []
    while p + 4 <= end:
        kind, size = data[p], int.from_bytes(data[p + 1:p + 3], "little")
        p += 4 + (2 if flags & 0x04 else 0)
        messages.append((kind, p, size))
        p += size
    return messages


def test_hdf5_chunks_never_written_read_as_the_fill_value(tmp_path, optstate_cli):
    """A dataset h5py made and then wrote in part holds no chunk where nothing was written, and
    libhdf5 reads its fill value there. The checks before each read (every chunk's stored size,
    looked up by the chunk's key) pass over those: the state reads as the one written whole with
    zeros there, 1-D and 2-D, in h5py's default file format (a B-tree of chunks) and in 1.10's."""
    h5py = pytest.importorskip("h5py")
    import numpy as np
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    with h5py.File(tmp_path / "s.h5", "r") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and o.dtype == np.float32
                     and o.shape and o.shape[0] >= 4 else None)
        picked = [next(n for n in names if f[n].ndim == 2), next(n for n in names if f[n].ndim == 1)]
    with h5py.File(tmp_path / "s.h5", "r+") as f:  # the state with zeros where no chunk will be
        for name in picked:
            f[name][1::2] = 0
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    for libver in ("earliest", "v110"):
        sparse = tmp_path / f"sparse_{libver}.h5"
        rebuild_with_h5py(h5py, tmp_path / "s.h5", sparse, libver)
        with h5py.File(sparse, "r+") as f:
            for name in picked:
                values, attrs = f[name][...], dict(f[name].attrs)
                del f[name]
                d = f.create_dataset(name, shape=values.shape, dtype=values.dtype, chunks=(1,) + values.shape[1:],
                                     fletcher32=True, fillvalue=np.float32(0))
                d[0::2] = values[0::2]
                d.attrs.update(attrs)
                assert d.id.get_num_chunks() == (values.shape[0] + 1) // 2, name
        assert hashes(optstate_cli, sparse, values=True) == want, libver
        optstate_cli("validate", sparse)


def test_hdf5_file_space_options_of_h5py(tmp_path, optstate_cli):
    """h5py's file space options (paged aggregation, free space kept in the file) put a file space
    info message into the superblock extension, which libhdf5 1.10.8 decodes inside H5Fopen without
    bounds: optstate checks it before H5Fopen runs. The file reads as the same state; a page size of
    0 there (libhdf5 divides by it) is refused naming the file and the extension."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    paged = tmp_path / "paged.h5"
    rebuild_with_h5py(h5py, tmp_path / "s.h5", paged, "v110", fs_strategy="page", fs_persist=True,
                      fs_page_size=8192)
    data = paged.read_bytes()
    fsinfo = [m for m in superblock_extension_messages(data) if m[0] == 0x17]
    assert len(fsinfo) == 1, superblock_extension_messages(data)
    _, at, size = fsinfo[0]
    assert data[at] == 1 and data[at + 1] == 1 and data[at + 2] == 1  # version 1, paged, persisted
    assert int.from_bytes(data[at + 11:at + 19], "little") == 8192
    assert hashes(optstate_cli, paged, values=True) == want
    optstate_cli("validate", paged)
    bad = bytearray(data)
    bad[at + 11:at + 19] = bytes(8)
    (tmp_path / "page0.h5").write_bytes(bad)
    err = run_err(optstate_cli, "inspect", tmp_path / "page0.h5")
    assert f"{tmp_path / 'page0.h5'}: the superblock extension at " in err, err
    assert "a file space page size of 0 bytes (512 B to 1 GiB)" in err, err


def test_hdf5_committed_datatypes_of_h5py(tmp_path, optstate_cli):
    """A datatype h5py commits (`f["t"] = np.dtype(...)`) is kept in its own object header, and the
    datasets and attributes of that type hold a shared message naming it: libhdf5 decodes the
    committed one in their place, and so optstate checks it there. A param's moment and a root
    attribute of committed types read as the same state; the committed type's class byte changed
    is refused naming the dataset and the committed datatype's header."""
    h5py = pytest.importorskip("h5py")
    import numpy as np
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    committed = tmp_path / "committed.h5"
    rebuild_with_h5py(h5py, tmp_path / "s.h5", committed, "earliest")
    with h5py.File(committed, "r+") as f:
        f["f32"] = np.dtype("<f4")
        f["i32"] = np.dtype("<i4")
        values = f["0.bias/exp_avg"][...]
        del f["0.bias/exp_avg"]
        f.create_dataset("0.bias/exp_avg", data=values, dtype=f["f32"])
        f.attrs.create("epoch", 7, dtype=f["i32"])
        assert f["0.bias/exp_avg"].id.get_type().committed() and f.attrs.get_id("epoch").get_type().committed()
    assert hashes(optstate_cli, committed, values=True) == want
    optstate_cli("validate", committed)
    with h5py.File(committed, "r") as f:
        type_header = h5py.h5o.get_info(f["f32"].id).addr
    data = bytearray(committed.read_bytes())
    # Version 1 object header: 16 bytes, then the first message's type(2) size(2) flags(1) reserved(3).
    assert data[type_header] == 1 and int.from_bytes(data[type_header + 16:type_header + 18], "little") == 3
    data[type_header + 24] = 0x1f  # the float's class (1) turned 15, which no datatype has
    (tmp_path / "bad_type.h5").write_bytes(data)
    err = run_err(optstate_cli, "inspect", tmp_path / "bad_type.h5")
    assert f"its committed datatype's object header at {type_header}: a datatype message" in err, err
    assert "dataset '/0.bias/exp_avg'" in err and str(tmp_path / "bad_type.h5") in err, err


def test_composer_dcp_with_an_int_initial_lr(tmp_path, optstate_cli):
    """DecoupledAdamW's initial_lr as an int (lr=1: a scheduler copies the lr it is given): the decay
    divided by it reads as the plain nesting's, and DCP -> DCP writes Composer's layout back item for
    item, the int included."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    src = tmp_path / "composer"
    run_script(tmp_path, MAKE_COMPOSER_DCP, "make_composer.py", src, "int-lr")
    dcp_to_torch_save(src, tmp_path / "src.pt")
    a = torch.load(tmp_path / "src.pt", weights_only=False)
    group = a["state"]["optimizers"]["DecoupledAdamW"]["param_groups"][0]
    assert group["initial_lr"] == 1 and type(group["initial_lr"]) is int, group
    assert hashes(optstate_cli, src) == hashes(optstate_cli, str(src) + ".plain")
    assert_converts_to_ref(optstate_cli, src, tmp_path / "state.safetensors")
    optstate_cli("convert", src, tmp_path / "copy", "--format", "dcp")
    dcp_to_torch_save(tmp_path / "copy", tmp_path / "copy.pt")
    assert deep_equal(a, torch.load(tmp_path / "copy.pt", weights_only=False))


def test_hdf5_deflate_bombs_are_refused_before_libhdf5_inflates_them(tmp_path, optstate_cli):
    """libhdf5's deflate filter inflates a chunk to whatever size that comes to, holding all of it,
    then uses its chunk's bytes: a few hundred KB of deflated zeros in place of a chunk made a read
    hold 256 MiB and succeed. optstate inflates each large deflated chunk first, counting, and
    refuses one past twice its chunk's bytes (or stored in more than that) naming the dataset and
    the chunk, before libhdf5 reads it. The file as optstate wrote it (`--compress`) reads the
    same."""
    h5py = pytest.importorskip("h5py")
    import zlib
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 1024))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    optstate_cli("convert", tmp_path / "opt.pt", tmp_path / "s.h5", "--compress", "4")
    assert hashes(optstate_cli, tmp_path / "s.h5", values=True) == hashes(optstate_cli, tmp_path / "opt.pt", values=True)
    optstate_cli("validate", tmp_path / "s.h5")

    def zeros_deflated(mib):
        c = zlib.compressobj(9)
        return b"".join(c.compress(bytes(1 << 20)) for _ in range(mib)) + c.flush()

    # The chunk of /0/exp_avg (64 x 1024 floats: 256 KiB) as 256 MiB of zeros in ~250 KB, with
    # 4 bytes where fletcher32's checksum goes (applied after deflate: never reached); that of
    # /0/exp_avg_sq as 600 MiB in ~580 KB, more than a chunk of 256 KiB inflated can be stored in.
    for name, mib, want in (("exp_avg", 256, "inflates to more than 525312 bytes, its chunks hold 262144"),
                            ("exp_avg_sq", 600, "more than its 525312 bytes decompressed can be")):
        bomb = tmp_path / f"bomb_{name}.h5"
        shutil.copy(tmp_path / "s.h5", bomb)
        blob = zeros_deflated(mib)
        with h5py.File(bomb, "r+") as f:
            assert f[f"0/{name}"].chunks == (64, 1024) and f[f"0/{name}"].compression == "gzip"
            f[f"0/{name}"].id.write_direct_chunk((0, 0), blob + bytes(4), 0)
        err = run_err(optstate_cli, "inspect", bomb)
        assert f"dataset '/0/{name}': the chunk at [0, 0]" in err and want in err and str(bomb) in err, err


def test_hdf5_szip_chunks_reading_and_a_lying_size(tmp_path, optstate_cli):
    """h5py's szip compression (libaec in both HDF5s) reads the same. An szip chunk starts with the
    size it decompresses to, which libhdf5 allocates and fills (up to 4 GiB): one saying more than
    twice its chunk's bytes is refused naming the dataset and the chunk, before libhdf5 reads it."""
    h5py = pytest.importorskip("h5py")
    if not h5py.h5z.filter_avail(h5py.h5z.FILTER_SZIP):
        pytest.skip("h5py's HDF5 has no szip")
    p = torch.nn.Parameter(torch.zeros(64, 1024))  # constant moments: szip makes them smaller
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones_like(p)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    optstate_cli("convert", tmp_path / "opt.pt", tmp_path / "s.h5")
    szip = tmp_path / "szip.h5"
    with h5py.File(tmp_path / "s.h5", "r") as s, h5py.File(szip, "w") as d:
        for k, v in s.attrs.items():
            d.attrs[k] = v.decode() if isinstance(v, bytes) else v
        def copy(name, obj):  # returns None: visititems stops at anything else
            if isinstance(obj, h5py.Group):
                d.require_group(name)
            else:
                d.create_dataset(name, data=obj[...], chunks=obj.chunks, compression="szip", fletcher32=True)
        s.visititems(copy)
    assert hashes(optstate_cli, szip, values=True) == hashes(optstate_cli, tmp_path / "opt.pt", values=True)
    optstate_cli("validate", szip)
    with h5py.File(szip, "r+") as f:
        mask, raw = f["0/exp_avg"].id.read_direct_chunk((0, 0))
        assert mask == 0 and int.from_bytes(raw[:4], "little") == 64 * 1024 * 4, (mask, len(raw))
        f["0/exp_avg"].id.write_direct_chunk((0, 0), (0xFFFFFFF0).to_bytes(4, "little") + raw[4:], 0)
    err = run_err(optstate_cli, "inspect", szip)
    assert "dataset '/0/exp_avg': the chunk at [0, 0] says it decompresses to 4294967280 bytes" in err, err


def global_heap_objects(data, at):
    """(offset, index, size) of each object of the global heap collection at `at` (lengths of 8
    bytes), as libhdf5 walks it."""
    assert data[at:at + 5] == b"GCOL\x01"
    size = int.from_bytes(data[at + 8:at + 16], "little")
    p, objects = at + 16, []
    while p + 16 <= at + size:
        index, obj_size = int.from_bytes(data[p:p + 2], "little"), int.from_bytes(data[p + 8:p + 16], "little")
        objects.append((p, index, obj_size))
        p += 16 + (obj_size + 7) // 8 * 8 if index else obj_size
    return objects


def test_hdf5_damaged_global_heap_is_refused_not_a_hang(tmp_path, optstate_cli):
    """libhdf5 (1.10.8, and HDF5 2.0 under h5py) loops without end loading a global heap collection
    whose walk meets a free-space object of size 0. Two such damages of the collection h5py stored the
    root's str attributes in: the free space's own size zeroed, and the format tag's object made to
    claim more bytes (the walk lands on zeros inside the free space). optstate refuses each, naming
    the attribute and the collection, within the time limit instead of never returning."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    rebuild_with_h5py(h5py, tmp_path / "s.h5", tmp_path / "h.h5", "earliest")
    data = (tmp_path / "h.h5").read_bytes()
    at = data.index(b"GCOL")
    objects = global_heap_objects(data, at)
    free = [o for o in objects if o[1] == 0]
    tag = [o for o in objects if data[o[0] + 16:o[0] + 16 + o[2]] == b"optstate-hdf5"]
    assert len(free) == 1 and len(tag) == 1, objects
    damages = {
        "free space of size 0": (free[0][0] + 8, 0, "(index 0, free space) has size 0"),
        "tag claims 120 bytes": (tag[0][0] + 8, 120, f"global heap object {tag[0][1]} holds 120 bytes, the value says 13"),
    }
    exe = Path(os.environ.get("OPTSTATE_BUILD_DIR", Path(__file__).resolve().parents[2] / "build")) / "optstate"
    for name, (offset, value, want) in damages.items():
        bad = bytearray(data)
        bad[offset:offset + 8] = value.to_bytes(8, "little")
        path = tmp_path / f"{name.replace(' ', '_')}.h5"
        path.write_bytes(bad)
        proc = subprocess.run([str(exe), "inspect", str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (name, proc.returncode, proc.stdout)
        assert f"attribute 'format': its global heap collection at {at}: " in proc.stderr, (name, proc.stderr)
        assert want in proc.stderr and str(path) in proc.stderr, (name, proc.stderr)


def iter_objects(group):
    for obj in group.values():
        yield obj
        if hasattr(obj, "keys"):  # a group
            yield from iter_objects(obj)


# ---- hostile inputs ----

def run_err(optstate_cli, *args):
    proc = optstate_cli(*args, check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    return proc.stderr


def test_pickle_interpreter_never_executes_and_bounds_its_work(tmp_path, optstate_cli):
    ck = make_dcp(tmp_path, "fp32")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))
    bad = tmp_path / "evil"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(Evil(), protocol=4))
    err = run_err(optstate_cli, "inspect", bad)
    assert "not a DCP Metadata object" in err and ".metadata" in err
    assert not (tmp_path / "pwned").exists()
    # 100k nested lists: refused by the depth cap, no stack overflow
    (bad / ".metadata").write_bytes(b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b".")
    assert "nesting deeper than" in run_err(optstate_cli, "inspect", bad)
    # a 2^60-byte string: refused before allocating
    (bad / ".metadata").write_bytes(b"\x80\x04\x8d" + (1 << 60).to_bytes(8, "little") + b"abc.")
    assert "declares 1152921504606846976 bytes" in run_err(optstate_cli, "inspect", bad)
    # a cycle through the memo (a list that holds itself) is data, not a hang
    (bad / ".metadata").write_bytes(b"\x80\x04]\x94h\x00a.")
    assert "not a DCP Metadata object" in run_err(optstate_cli, "inspect", bad)
    del ck


@pytest.mark.parametrize("kind", ["fp32", "ao"])
def test_dcp_data_is_checked_against_the_crc32_torch_save_stored(tmp_path, optstate_cli, kind):
    import json
    import shutil
    ck = make_dcp(tmp_path, kind)
    report = json.loads(optstate_cli("validate", ck, "--json").stdout)
    assert report["ok"] and report["checksums_verified"] is True
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    # one bit of one storage flipped, the zip records untouched: every full read names the item
    md = pickle.loads((ck / ".metadata").read_bytes())
    fqn = next(i.fqn for i in md.storage_data if i.fqn.endswith("0.weight.exp_avg"))
    loc = next(v for i, v in md.storage_data.items() if i.fqn == fqn)
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    data = bytearray((bad / loc.relative_path).read_bytes())
    # the middle byte of the item's first storage record (torch.save's zip: `<archive>/data/<key>`)
    import io
    import struct
    import zipfile
    with zipfile.ZipFile(io.BytesIO(bytes(data[loc.offset:loc.offset + loc.length]))) as zf:
        rec = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size > 0)
    header = loc.offset + rec.header_offset
    name_len, extra_len = struct.unpack("<HH", data[header + 26:header + 30])
    at = header + 30 + name_len + extra_len + rec.file_size // 2
    data[at] ^= 0x10
    (bad / loc.relative_path).write_bytes(bytes(data))
    for cmd in (["hash"], ["hash", "--values"], ["convert"]):
        args = cmd[:1] + [bad] + ([tmp_path / "out"] if cmd[0] == "convert" else []) + cmd[1:]
        err = run_err(optstate_cli, *args)
        assert f"item '{fqn}'" in err and "fails the CRC-32 torch.save stored" in err, err
    assert not (tmp_path / "out").exists()
    proc = optstate_cli("validate", bad, check=False)
    assert proc.returncode == 1, proc.stdout
    assert f"item '{fqn}'" in proc.stdout and "fails the CRC-32 torch.save stored" in proc.stdout, proc.stdout
    # and optstate.load, which reads each chunk into place (a whole record here: one rank saved it)
    import optstate
    model = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 3))
    opt = (optstate.AdamW8bit(model.parameters(), block_size=64) if kind == "ao"
           else optstate.FusedAdamW(model.parameters()))
    with pytest.raises(Exception, match=f"item '{fqn}' chunk at .*fails the CRC-32 torch.save stored"):
        optstate.load(bad, model, opt)
    optstate.load(ck, model, opt)
    # A bytes item (a param group's weight_decay, a Python float in its data.pkl) with one bit of the
    # number flipped: its record's CRC-32 is the only check that sees it.
    key = "optim.param_groups.0.weight_decay"
    loc = next(v for i, v in md.storage_data.items() if i.fqn == key)
    bad = tmp_path / "bad_group"
    shutil.copytree(ck, bad)
    data = bytearray((bad / loc.relative_path).read_bytes())
    item = bytes(data[loc.offset:loc.offset + loc.length])
    at = loc.offset + item.index(b"G" + struct.pack(">d", 0.05 if kind != "ao" else 0.01)) + 8
    data[at] ^= 0x01
    (bad / loc.relative_path).write_bytes(bytes(data))
    err = run_err(optstate_cli, "hash", bad)
    assert f"item '{key}'" in err and "CRC-32 of record" in err and "data.pkl" in err, err


def test_truncated_or_garbled_dcp_names_the_item(tmp_path, optstate_cli):
    import shutil
    ck = make_dcp(tmp_path, "fp32")
    meta = (ck / ".metadata").read_bytes()
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    (bad / ".metadata").write_bytes(meta[: len(meta) // 2])
    assert ".metadata" in run_err(optstate_cli, "inspect", bad)
    (bad / ".metadata").write_bytes(meta[:100] + b"\xff" * 50 + meta[150:])
    assert ".metadata" in run_err(optstate_cli, "inspect", bad)
    # item bytes beyond the end of the data file
    (bad / ".metadata").write_bytes(meta)
    data = (ck / "__0_0.distcp").read_bytes()
    (bad / "__0_0.distcp").write_bytes(data[: len(data) - 1000])
    err = run_err(optstate_cli, "inspect", bad)
    assert "item '" in err and "beyond the end" in err
    # a lying storage length, rewritten into a valid .metadata
    md = pickle.loads(meta)
    idx = next(i for i in md.storage_data if i.fqn == "optim.state.0.weight.exp_avg")
    md.storage_data[idx].length += 10 ** 12
    (bad / "__0_0.distcp").write_bytes(data)
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    err = run_err(optstate_cli, "hash", bad)
    assert "optim.state.0.weight.exp_avg" in err and "beyond the end" in err
    # garbled zip inside an item: its central directory
    md.storage_data[idx].length -= 10 ** 12
    loc = md.storage_data[idx]
    broken = bytearray(data)
    end = loc.offset + loc.length
    broken[end - 22:end] = b"\0" * 22
    (bad / ".metadata").write_bytes(meta)
    (bad / "__0_0.distcp").write_bytes(bytes(broken))
    err = run_err(optstate_cli, "hash", bad)
    assert "optim.state.0.weight.exp_avg" in err and "zip" in err
    # a path that leaves the checkpoint
    md.storage_data[idx].relative_path = "../../etc/passwd"
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    assert "optim.state.0.weight.exp_avg" in run_err(optstate_cli, "inspect", bad)
    # an absolute path, a missing data file, a negative offset, no storage record at all
    for change, want in [(lambda m: setattr(m.storage_data[idx], "relative_path", "/etc/passwd"), "is absolute"),
                         (lambda m: setattr(m.storage_data[idx], "relative_path", "__9_0.distcp"),
                          "__9_0.distcp: no such file"),
                         (lambda m: setattr(m.storage_data[idx], "offset", -5), "negative offset"),
                         (lambda m: m.storage_data.pop(idx), "has no storage record")]:
        md = pickle.loads(meta)
        change(md)
        (bad / ".metadata").write_bytes(pickle.dumps(md))
        err = run_err(optstate_cli, "hash", bad)
        assert "optim.state.0.weight.exp_avg" in err and want in err, err


def test_optstate_load_resumes_its_optimizers_from_torch_and_torchao_dcp(tmp_path):
    """optstate.load reads any detected format: a torch AdamW DCP into FusedAdamW, a torchao 8-bit
    DCP into AdamW8bit (codes taken as stored)."""
    import optstate
    ref_dcp = make_dcp(tmp_path, "fp32")
    ref = torch.load(str(ref_dcp) + ".ref.pt")
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 3))
    opt = optstate.FusedAdamW(model.parameters())
    optstate.load(ref_dcp, model, opt)
    assert opt.param_groups[0]["weight_decay"] == 0.05
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[name + ".param"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref[name + ".exp_avg_sq"])
        assert opt.state[p]["step"].item() == 3
    assert optstate.verify(ref_dcp, model, opt) == []
    pytest.importorskip("torchao")
    ao = make_dcp(tmp_path, "ao")
    ref8 = torch.load(str(ao) + ".ref.pt")
    model8 = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 3))
    opt8 = optstate.AdamW8bit(model8.parameters(), block_size=64)
    optstate.load(ao, model8, opt8)
    st = opt8.state[model8[0].weight]
    deq = optstate.ops.dequantize_blockwise(st["exp_avg_codes"], st["exp_avg_absmax"], 64, "dynamic-signed")
    assert torch.equal(deq, ref8["0.weight.exp_avg"].float())
    assert optstate.verify(ao, model8, opt8) == []


def test_dcp_of_a_module_named_state_keeps_its_weights(tmp_path, optstate_cli):
    """A top-level module named "state" gives weights `model.state.weight`: they are the model's
    (planner path ("model", "state.weight")), not flattened optimizer state."""
    script = textwrap.dedent("""
        import sys, torch, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"state": torch.nn.Linear(8, 4), "head": torch.nn.Linear(4, 2)})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model["head"](model["state"](torch.randn(3, 8))).sum().backward()
        opt.step()
        m, o = get_state_dict(model, opt)
        dcp.save({"model": m, "optim": o}, checkpoint_id=sys.argv[1])
        torch.save({k: v.detach() for k, v in model.state_dict().items()}, sys.argv[1] + ".weights.pt")
    """)
    out = tmp_path / "st"
    run_script(tmp_path, script, "st.py", out)
    optstate_cli("convert", out, tmp_path / "st.safetensors")
    got = st_load(tmp_path / "st.safetensors")
    for name, w in torch.load(str(out) + ".weights.pt").items():
        assert torch.equal(got[name + ".param"], w), name


MAKE_ACCELERATE_DCP = textwrap.dedent("""
    # What Hugging Face Accelerate (and so the Trainer) saves under FSDP1 with SHARDED_STATE_DICT:
    # checkpoint-N/optimizer_0/, a DCP of {"optimizer": FSDP.optim_state_dict(model, opt)} (keyed by
    # fqn; ShardedTensors, or DTensors when FSDP has a device_mesh), beside pytorch_model_fsdp_0/, a
    # DCP of {"model": model.state_dict()}. Nested units; rows that leave an uneven last shard.
    import os, sys, torch, torch.distributed as dist, torch.nn as nn
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import ShardedStateDictConfig, ShardedOptimStateDictConfig
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor import DTensor
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    orig, with_mesh, out = sys.argv[1] == "orig", sys.argv[2] == "mesh", sys.argv[3]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 25), nn.ReLU(), nn.Linear(25, 5))
    kwargs = {}
    if with_mesh:
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["device_mesh"] = init_device_mesh("cpu", (world,))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=orig,
                 device_id=torch.device("cpu"), **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(4, 16, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        osd = FSDP.optim_state_dict(model, opt)
        dcp.save({"optimizer": osd}, checkpoint_id=f"{out}/optimizer_0")
        dcp.save({"model": model.state_dict()}, checkpoint_id=f"{out}/pytorch_model_fsdp_0")
    # The reference: each sharded moment put together by torch itself (ShardedTensor.gather,
    # DTensor.full_tensor), independently of the DCP files.
    ref = {}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if k == "step":
                ref[f"{fqn}.step"] = float(v)
                continue
            assert isinstance(v, DTensor) == with_mesh, type(v)
            if with_mesh:
                full = v.full_tensor()
            else:
                full = torch.zeros(v.size()) if rank == 0 else None
                v.gather(0, full)
            ref[f"{fqn}.{k}"] = full
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):  # the weights, gathered by torch
        for fqn, w in model.state_dict().items():
            ref[f"{fqn}.param"] = w.clone()
    if rank == 0:
        torch.save(ref, f"{out}.ref")
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("mode,mesh", [("flat", "sharded_tensor"), ("orig", "sharded_tensor"), ("flat", "mesh")])
def test_accelerate_fsdp1_sharded_dcp_reads_as_the_state_torch_gathers(tmp_path, optstate_cli, mode, mesh):
    """The optimizer_0/ DCP of an Accelerate (Hugging Face Trainer) FSDP1 run reads as the state torch
    gathers from its own shards, by name; it converts to a torch.optim.AdamW state_dict that loads
    over the unwrapped model. The checkpoint folder itself reads as the same state with its params'
    weights, from pytorch_model_fsdp_0/ beside it, as torch gathers them."""
    out = tmp_path / "checkpoint-3"
    run_script(tmp_path, MAKE_ACCELERATE_DCP, "accelerate_fsdp1.py", mode, mesh, out, ranks=2)
    ref = torch.load(str(out) + ".ref")
    (out / "trainer_state.json").write_text("{}")  # what else the Trainer keeps there
    folder = json.loads(optstate_cli("inspect", out, "--json").stdout)
    assert folder["format"] == "dcp" and sorted(folder["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert folder["read_notes"] == ["Hugging Face Accelerate's folder: the optimizer's DCP optimizer_0/ read with the "
                                    "model's weights in pytorch_model_fsdp_0/ (a DCP)"], folder["read_notes"]
    optstate_cli("validate", out)
    optstate_cli("convert", out, tmp_path / "full.safetensors")
    full = st_load(tmp_path / "full.safetensors")
    assert sorted(full) == sorted(k for k in ref if not k.endswith(".step"))
    for k in ref:
        if not k.endswith(".step"):
            assert torch.equal(full[k], ref[k]), k
    # a training run's folder: a write never replaces it
    r = optstate_cli("convert", tmp_path / "full.safetensors", out, "--overwrite", check=False)
    assert r.returncode == 2 and "never replaces" in r.stderr, r.stderr
    assert (out / "trainer_state.json").exists()
    # DCP -> DCP from the folder: one DCP with both (torch's dcp.load finds model.* and optimizer.*)
    optstate_cli("convert", out, tmp_path / "merged", "--format", "dcp")
    assert hashes(optstate_cli, tmp_path / "merged") == hashes(optstate_cli, out)
    ck = out / "optimizer_0"
    doc = json.loads(optstate_cli("inspect", ck, "--json").stdout)
    assert doc["format"] == "dcp" and sorted(doc["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert doc["ranks"] == 2  # the two ranks' __R_0.distcp
    optstate_cli("validate", ck)
    optstate_cli("convert", ck, tmp_path / "plain.safetensors")
    got = st_load(tmp_path / "plain.safetensors")
    moments = [k for k in ref if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(moments) == 8 and "0.weight.param" not in got  # optimizer_0/ alone holds no weights
    for k in moments:
        assert torch.equal(got[k], ref[k]), k
    # plain torch state, keyed by name: it loads into torch.optim.AdamW over the unwrapped model
    optstate_cli("convert", ck, tmp_path / "plain.pt")
    sd = torch.load(tmp_path / "plain.pt")  # no weights in optimizer_0/: the optimizer's state_dict alone
    model = torch.nn.Sequential(torch.nn.Linear(16, 25), torch.nn.ReLU(), torch.nn.Linear(25, 5))
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(sd)
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        assert float(st["step"]) == ref[f"{names[p]}.step"] == 3.0
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], ref[f"{names[p]}.{k}"]), (names[p], k)
    # DCP -> DCP keeps Accelerate's key and the values
    optstate_cli("convert", ck, tmp_path / "again", "--format", "dcp")
    assert hashes(optstate_cli, tmp_path / "again") == hashes(optstate_cli, ck)
    from torch.distributed.checkpoint import FileSystemReader
    keys = [set(FileSystemReader(str(d)).read_metadata().state_dict_metadata) for d in (ck, tmp_path / "again")]
    assert keys[0] == keys[1] and "optimizer.state.0.weight.exp_avg" in keys[0]


KEEP_FLAGS = """
import sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
out, flat = sys.argv[1], sys.argv[2] == "flat"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # torchtitan's default implementation
model(torch.randn(8, 16)).square().sum().backward()
opt.step()
from torch.distributed.checkpoint.state_dict import StateDictOptions
msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
# A release before decoupled_weight_decay (torch 2.6) saved no such field.
for k in [k for k in osd if k.endswith("decoupled_weight_decay")] if flat else []:
    del osd[k]
for g in [] if flat else osd["param_groups"]:
    del g["decoupled_weight_decay"]
dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
"""


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_dcp_rewrite_keeps_the_sources_optimizer_flags(tmp_path, optstate_cli, layout):
    """torch.optim.AdamW's groups hold implementation flags the state has no place for (fused, foreach,
    capturable, differentiable; decoupled_weight_decay since torch 2.7), and its load_state_dict
    takes a group as saved. A DCP -> DCP conversion or reshard keeps the source's values, so a fused
    run resumes fused; a flag the source lacks (a release before decoupled_weight_decay) gets
    torch.optim.AdamW's default, as a DCP from another source gets all of them, so that a strict
    dcp.load of today's torch finds it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    src = tmp_path / "src"
    run_script(tmp_path, KEEP_FLAGS, "keep_flags.py", src, layout)

    def groups(ck):
        keys = set(FileSystemReader(str(ck)).read_metadata().state_dict_metadata)
        dcp_to_torch_save(ck, tmp_path / (ck.name + ".pt"))
        sd = torch.load(tmp_path / (ck.name + ".pt"), weights_only=False)["optim"]
        fields = sd["param_groups"] if isinstance(sd.get("param_groups"), list) else \
            [{k: v for k, v in sd.items() if k.startswith("param_groups.")}]  # flattened: per-param keys
        return {k for k in keys if ".param_groups." in k}, fields

    keys, fields = groups(src)
    assert not any(k.endswith("decoupled_weight_decay") for k in keys) and any(k.endswith(".fused") for k in keys)
    assert any(v is True for g in fields for k, v in g.items() if k.endswith("fused"))
    for args in (("convert", src, tmp_path / "converted", "--format", "dcp", "--to", "fp32"),
                 ("reshard", src, tmp_path / "resharded", "--format", "dcp", "--world-size", "2")):
        optstate_cli(*args)
        out_keys, out_fields = groups(args[2])
        added = out_keys - keys
        assert keys <= out_keys and added and all(k.endswith(".decoupled_weight_decay") for k in added), added
        assert [{k: v for k, v in g.items() if not k.endswith("decoupled_weight_decay")} for g in out_fields] == \
            fields, args[0]  # fused=True among them
        assert all(v is True for g in out_fields for k, v in g.items() if k.endswith("decoupled_weight_decay"))
        assert hashes(optstate_cli, args[2]) == hashes(optstate_cli, src)
    # Through optstate's own format the source's flags are gone: torch.optim.AdamW's defaults.
    optstate_cli("convert", src, tmp_path / "native")
    optstate_cli("convert", tmp_path / "native", tmp_path / "fresh", "--format", "dcp")
    fresh_keys, fresh_fields = groups(tmp_path / "fresh")
    assert any(k.endswith("decoupled_weight_decay") for k in fresh_keys)
    fused = [v for k, v in fresh_fields[0].items() if k.endswith("fused")]
    assert fused and all(v is None for v in fused), fused


ADAMW_SWITCHES = ("foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def test_torch_save_and_dcp_conversions_keep_a_fused_runs_switches(tmp_path, optstate_cli):
    """A fused run's optimizer.pt (HF Trainer's adamw_torch_fused, a loop's {model, optimizer,
    epoch}) converted to torch.save or DCP and back keeps each group's switches (fused=True, a
    group's own foreach=False), so a fresh torch.optim.AdamW built without them resumes fused, step
    for step as the original; through safetensors, which has no place for them, torch's defaults."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def groups_of(m, **switches):
        return [{"params": list(m[0].parameters())},
                {"params": list(m[2].parameters()), "weight_decay": 0.0, **switches}]

    opt = torch.optim.AdamW(groups_of(model, foreach=False), lr=1e-3, fused=True)
    batches = [torch.randn(8, 16) for _ in range(3)]
    for x in batches[:2]:
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2}, tmp_path / "loop.pt")

    def switches(groups):
        return [{k: g.get(k, "absent") for k in ADAMW_SWITCHES} for g in groups]

    want = switches(opt.state_dict()["param_groups"])
    assert [g["fused"] for g in want] == [True, True] and [g["foreach"] for g in want] == [None, False]
    optstate_cli("convert", tmp_path / "optimizer.pt", tmp_path / "out.pt")
    optstate_cli("convert", tmp_path / "loop.pt", tmp_path / "loop_out.pt")
    optstate_cli("convert", tmp_path / "optimizer.pt", tmp_path / "dcp", "--format", "dcp")
    optstate_cli("convert", tmp_path / "dcp", tmp_path / "back.pt")
    for name in ("out.pt", "back.pt"):
        assert switches(torch.load(tmp_path / name, weights_only=True)["param_groups"]) == want, name
    loop = torch.load(tmp_path / "loop_out.pt", weights_only=True)
    assert switches(loop["optimizer"]["param_groups"]) == want and loop["epoch"] == 2
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    assert switches(torch.load(tmp_path / "dcp.pt", weights_only=True)["optim"]["param_groups"]) == want
    # inspect names them: in JSON each group's, as text those set otherwise than torch's defaults.
    for path in (tmp_path / "optimizer.pt", tmp_path / "dcp"):
        groups = json.loads(optstate_cli("inspect", path, "--json", "--no-stats").stdout)["param_groups"]
        assert [g["adamw_switches"] for g in groups] == want, path
    lines = [ln for ln in optstate_cli("inspect", tmp_path / "dcp", "--no-stats").stdout.splitlines()
             if ln.startswith("group ")]
    assert "fused=True" in lines[0] and "foreach" not in lines[0] and "foreach=False fused=True" in lines[1], lines

    # Resumed from the DCP round trip by an optimizer built with torch's defaults: fused, as the original.
    resumed_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    resumed_model.load_state_dict(model.state_dict())
    resumed = torch.optim.AdamW(groups_of(resumed_model), lr=1e-3)
    resumed.load_state_dict(torch.load(tmp_path / "back.pt", weights_only=True))
    assert [g["fused"] for g in resumed.param_groups] == [True, True]
    for m, o in ((model, opt), (resumed_model, resumed)):
        m(batches[2]).square().sum().backward()
        o.step()
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)

    optstate_cli("convert", tmp_path / "optimizer.pt", tmp_path / "plain.safetensors")
    optstate_cli("convert", tmp_path / "plain.safetensors", tmp_path / "plain.pt")
    plain = switches(torch.load(tmp_path / "plain.pt", weights_only=True)["param_groups"])
    assert [g["fused"] for g in plain] == [None, None] and [g["foreach"] for g in plain] == [None, None]


def test_group_extras_survive_torch_save_dcp_conversions_and_tell_flattened_groups_apart(tmp_path, optstate_cli):
    """A param group's own keys (a layer-wise `lr_scale`, a `name`, the LR scheduler's
    `initial_lr`) are what the loop reads back: torch.save -> DCP -> torch.save keeps them, a
    flattened DCP (torchtitan's layout) keeps its groups apart by them (two groups with one lr and
    other lr_scales were one group before) and a scheduler rebuilt to resume takes the result;
    torchao's tensor initial_lr stays a tensor where lr does (DCP of its 8-bit items) and becomes a
    float where lr does (torch.optim.AdamW's .pt). Formats with no place for them name them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW([{"params": list(model[0].parameters()), "lr_scale": 0.5, "name": "body"},
                             {"params": list(model[2].parameters()), "lr_scale": 1.0, "name": "head"}], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    for _ in range(2):
        model(torch.randn(8, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    extras = ("lr_scale", "name", "initial_lr")

    def extras_of(groups):
        return [{k: g.get(k, "absent") for k in extras} for g in groups]

    want = extras_of(opt.state_dict()["param_groups"])
    assert want == [{"lr_scale": 0.5, "name": "body", "initial_lr": 1e-3},
                    {"lr_scale": 1.0, "name": "head", "initial_lr": 1e-3}]
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    proc = optstate_cli("convert", tmp_path / "optimizer.pt", tmp_path / "dcp", "--format", "dcp")
    assert "kept param groups 0-1 'lr_scale', param groups 0-1 'name', param groups 0-1 'initial_lr'" in proc.stdout, \
        proc.stdout
    assert "note" not in proc.stderr, proc.stderr
    optstate_cli("convert", tmp_path / "dcp", tmp_path / "back.pt")
    assert extras_of(torch.load(tmp_path / "back.pt", weights_only=True)["param_groups"]) == want
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    assert extras_of(torch.load(tmp_path / "dcp.pt", weights_only=True)["optim"]["param_groups"]) == want
    groups = json.loads(optstate_cli("inspect", tmp_path / "dcp", "--json", "--no-stats").stdout)["param_groups"]
    assert [g["extras"] for g in groups] == want
    line = optstate_cli("inspect", tmp_path / "dcp", "--no-stats").stdout.splitlines()[2]
    assert line.endswith("initial_lr=0.001 lr_scale=0.5 name='body' (2 params)"), line

    # torchtitan's flattened layout: each param holds its group's fields. Read back as two groups.
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, checkpoint_id=tmp_path / "flat")
    proc = optstate_cli("convert", tmp_path / "flat", tmp_path / "flat.pt")
    assert "lr_scheduler (7 items)" in proc.stderr and "param group" not in proc.stderr, proc.stderr
    flat = torch.load(tmp_path / "flat.pt", weights_only=True)
    assert extras_of(flat["optimizer"]["param_groups"]) == want
    assert [g["params"] for g in flat["optimizer"]["param_groups"]] == [[0, 1], [2, 3]]
    resumed_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    resumed = torch.optim.AdamW([{"params": list(resumed_model[0].parameters())},
                                 {"params": list(resumed_model[2].parameters())}], lr=1e-3)
    resumed.load_state_dict(flat["optimizer"])
    rebuilt = torch.optim.lr_scheduler.LambdaLR(resumed, lambda s: 0.9 ** s, last_epoch=2)
    assert rebuilt.base_lrs == [1e-3, 1e-3]
    assert [g["lr_scale"] for g in resumed.param_groups] == [0.5, 1.0]

    # Where the format has no place for them, convert names them.
    proc = optstate_cli("convert", tmp_path / "dcp", tmp_path / "plain.safetensors", "--json")
    assert "param group 1 'lr_scale'" in json.loads(proc.stdout)["not_carried"]
    assert "param groups 0-1 'initial_lr'" in proc.stderr and "not in" in proc.stderr, proc.stderr

    # torchao keeps lr, and so its scheduler's initial_lr, as tensors.
    pytest.importorskip("torchao")
    from torchao.optim import AdamW8bit
    big = torch.nn.Linear(128, 64)
    ao = AdamW8bit(big.parameters(), lr=1e-3)
    ao_sched = torch.optim.lr_scheduler.LambdaLR(ao, lambda s: 0.9 ** s)
    big(torch.randn(4, 128)).square().sum().backward()
    ao.step()
    ao_sched.step()
    assert isinstance(ao.state_dict()["param_groups"][0]["initial_lr"], torch.Tensor)
    torch.save(ao.state_dict(), tmp_path / "ao.pt")
    optstate_cli("convert", tmp_path / "ao.pt", tmp_path / "ao_plain.pt")
    plain = torch.load(tmp_path / "ao_plain.pt", weights_only=True)["param_groups"][0]
    assert type(plain["lr"]) is float and type(plain["initial_lr"]) is float
    assert plain["initial_lr"] == float(torch.tensor(1e-3))
    optstate_cli("convert", tmp_path / "ao.pt", tmp_path / "ao_dcp", "--format", "dcp", "--to", "8bit")
    dcp_to_torch_save(tmp_path / "ao_dcp", tmp_path / "ao_dcp.pt")
    group = torch.load(tmp_path / "ao_dcp.pt", weights_only=False)["optim"]["param_groups"][0]
    assert isinstance(group["lr"], torch.Tensor) and isinstance(group["initial_lr"], torch.Tensor)
    assert group["initial_lr"].dtype == torch.float32 and group["initial_lr"].item() == float(torch.tensor(1e-3))


def test_hdf5_links_to_other_files_are_refused_soft_links_followed(tmp_path, optstate_cli):
    """A param's group or a dataset reached through an external link (h5py.ExternalLink: the bytes
    of another file) is refused naming the link, before libhdf5 opens that file; a soft link (a
    path inside the file) reads the same state."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    soft = tmp_path / "soft.h5"
    shutil.copy(tmp_path / "s.h5", soft)
    with h5py.File(soft, "r+") as f:
        f.move("0.bias", "moved_bias")
        f["0.bias"] = h5py.SoftLink("/moved_bias")
        f.move("0.weight/exp_avg/codes", "moved_codes")
        f["0.weight/exp_avg/codes"] = h5py.SoftLink("/moved_codes")
    assert hashes(optstate_cli, soft, values=True) == want
    for target in ("0.bias", "0.weight/exp_avg", "0.weight/exp_avg/codes", "0.bias/exp_avg"):
        ext = tmp_path / "external.h5"
        shutil.copy(tmp_path / "s.h5", ext)
        with h5py.File(ext, "r+") as f:
            del f[target]
            f[target] = h5py.ExternalLink(str(tmp_path / "s.h5"), "/" + target)
        with h5py.File(ext, "r") as f:  # h5py follows it to the other file
            assert f[target] is not None
        err = run_err(optstate_cli, "inspect", ext)
        assert f"'/{target}' is an external link (to another file)" in err and str(ext) in err, err


def test_hdf5_soft_link_paths_through_groups_are_checked(tmp_path, optstate_cli):
    """libhdf5 resolves a soft link's path name by name, decoding the links of each group on the
    way: those groups' headers are checked first, as every group the reader looks a name up in is.
    Soft links into a group two levels down (absolute, and relative to a param's group) read the
    same state; a link message of that group claiming a longer name than it holds is refused naming
    the group; a path through another soft link is refused."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    soft = tmp_path / "soft.h5"
    rebuild_with_h5py(h5py, tmp_path / "s.h5", soft, "v110")
    with h5py.File(soft, "r+", libver="v110") as f:  # groups with link messages
        f.create_group("store/inner")
        f.move("0.bias", "store/inner/moved_bias")
        f["0.bias"] = h5py.SoftLink("/store/inner/moved_bias")
        f.create_group("0.weight/stash/deeper")
        f.move("0.weight/exp_avg_sq", "0.weight/stash/deeper/moved")
        f["0.weight/exp_avg_sq"] = h5py.SoftLink("stash/./deeper/moved")
        inner = h5py.h5o.get_info(f["store/inner"].id).addr
        store = h5py.h5o.get_info(f["store"].id).addr
    assert hashes(optstate_cli, soft, values=True) == want
    optstate_cli("validate", soft)
    # /store/inner's link to moved_bias (a version 2 header: "OHDR"), its name length 10 -> 127.
    data = bytearray(soft.read_bytes())
    assert data[inner:inner + 4] == b"OHDR"
    at = data.index(b"moved_bias", inner)
    assert data[at - 1] == 10
    data[at - 1] = 127
    (tmp_path / "bad_inner.h5").write_bytes(data)
    err = run_err(optstate_cli, "inspect", tmp_path / "bad_inner.h5")
    assert "group '/store/inner', on a soft link's path" in err and "holds a name of 127 bytes" in err, err
    assert str(tmp_path / "bad_inner.h5") in err and store != inner
    # A path through another soft link: /alias -> /store, /0.bias -> /alias/inner/moved_bias.
    through = tmp_path / "through.h5"
    shutil.copy(soft, through)
    with h5py.File(through, "r+") as f:
        f["alias"] = h5py.SoftLink("/store")
        del f["0.bias"]
        f["0.bias"] = h5py.SoftLink("/alias/inner/moved_bias")
        assert f["0.bias/exp_avg"] is not None  # h5py follows it
    err = run_err(optstate_cli, "inspect", through)
    assert "'/0.bias' is a soft link to '/alias/inner/moved_bias', a path through another link ('alias')" in err, err


def test_hdf5_h5py_earliest_root_of_many_params_reads_the_same(tmp_path, optstate_cli):
    """600 params rebuilt by h5py in its default format: the root's symbol table is a B-tree of two
    levels (past 2 x 16 symbol nodes of 8 entries each), every node, entry and name of which the
    check walks before libhdf5 looks a name up; it reads as the same state."""
    h5py = pytest.importorskip("h5py")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(600)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(3)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "many.pt")
    optstate_cli("convert", tmp_path / "many.pt", tmp_path / "s.h5")
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    rebuild_with_h5py(h5py, tmp_path / "s.h5", tmp_path / "earliest.h5", "earliest")
    assert b"TREE\x00\x01" in (tmp_path / "earliest.h5").read_bytes()  # a group node of level 1
    assert hashes(optstate_cli, tmp_path / "earliest.h5", values=True) == want


def test_hdf5_root_attributes_in_dense_storage_are_walked(tmp_path, optstate_cli):
    """400 root attributes (h5py, v110): kept in a fractal heap of indirect and direct blocks with
    a v2 B-tree name index of internal nodes, through which the check finds `format` and
    `optstate` before libhdf5 reads them: it reads the same. With the size of the first object
    of their global heap collection made huge (libhdf5 1.10.8 copied that many bytes: a heap
    overflow found by fuzz_hdf5_file) it is refused naming the attribute and collection."""
    h5py = pytest.importorskip("h5py")
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    path = tmp_path / "attrs.h5"
    rebuild_with_h5py(h5py, tmp_path / "s.h5", path, "v110", extra_root_attrs=400)
    data = path.read_bytes()
    assert b"FHIB" in data and b"BTIN" in data  # an indirect block; an internal node
    assert hashes(optstate_cli, path, values=True) == want
    # The collection `optstate` lies in: the first; its object 1's size (after index, refcount,
    # reserved: 8 bytes in) set to 2^52.
    at = data.index(b"GCOL")
    objects = global_heap_objects(data, at)
    p, index, size = objects[0]
    assert index == 1
    damaged = bytearray(data)
    damaged[p + 8:p + 16] = (1 << 52).to_bytes(8, "little")
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bytes(damaged))
    err = run_err(optstate_cli, "inspect", bad)
    assert f"its global heap collection at {at}" in err and "runs past the collection" in err, err


def test_hdf5_huge_root_attributes_in_dense_storage_are_read(tmp_path, optstate_cli):
    """An attribute message larger than its fractal heap's largest managed object (h5py, v110: a
    root of more than 8 attributes, one an array of 3,000 floats) is a huge object, kept where the
    heap's huge object B-tree says: the check reads it there as libhdf5 does (it decoded it
    unchecked before). The file reads the same; that message's dataspace rank made 33 is refused
    naming the dense storage."""
    h5py = pytest.importorskip("h5py")
    import numpy as np
    ao = make_dcp(tmp_path, "ao")
    optstate_cli("convert", ao, tmp_path / "s.h5")
    want = hashes(optstate_cli, tmp_path / "s.h5", values=True)
    path = tmp_path / "huge.h5"
    rebuild_with_h5py(h5py, tmp_path / "s.h5", path, "v110", extra_root_attrs=10)
    with h5py.File(path, "r+", libver="v110") as f:
        f.attrs["bigarray"] = np.arange(3000, dtype=np.float32)
    data = path.read_bytes()
    assert b"FRHP" in data and b"BTHD\x00\x01" in data  # the heap; a B-tree of huge objects (type 1)
    assert hashes(optstate_cli, path, values=True) == want
    # The message (version 3): version, flags, name size(2), datatype size(2), dataspace size(2),
    # charset, the name with its NUL, the datatype, then the dataspace (version 2: version, rank).
    at = data.index(b"bigarray\x00") - 9
    assert data[at] == 3, data[at:at + 24]
    type_size = int.from_bytes(data[at + 4:at + 6], "little")
    space = at + 9 + 9 + type_size
    assert data[space] == 2 and data[space + 1] == 1, data[space:space + 4]
    damaged = bytearray(data)
    damaged[space + 1] = 33
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bytes(damaged))
    err = run_err(optstate_cli, "inspect", bad)
    assert "a dataspace of rank 33" in err and str(bad) in err, err
