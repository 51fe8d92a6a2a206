"""Per-rank torch.save files of FSDP2 training (verl's optim_world_size_N_rank_R.pt and
model_world_size_N_rank_R.pt): real FSDP2 runs over gloo on loopback save them, and optstate reads
the directory as one optimizer state, checked against what every rank held.

Each rank also saves its local state as plain tensors (torchao's 8-bit moments dequantized by
torchao itself) beside the checkpoint; the test puts those together by rows (FSDP2's Shard(0)),
independently of optstate, and compares bit for bit.
"""
import json
import os
import shutil
import struct
import textwrap
import zipfile

import pytest
import torch

from conftest import REPO
from test_sharded import run_on_ranks

FSDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kind, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    # Rows that do not divide by the ranks (33, 5: short and empty last shards). For 8-bit, a weight
    # whose shards are whole 256-element blocks (128x64 over 2 ranks), and one that torchao
    # quantizes on one rank only (129x128: 65 rows, not whole blocks, and 64 rows, 32 blocks).
    hidden = 129 if kind.startswith("torchao") else 33
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, hidden), nn.ReLU(), nn.Linear(hidden, 5))
    mesh = None
    if kind == "hsdp":  # HSDP: (Replicate, Shard(0)) over a 2 x world/2 mesh
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if kind == "frozen":  # a param the optimizer holds but never steps (LoRA's base weights)
        model[0].weight.requires_grad_(False)
    if kind == "compiled":  # torchtitan's per-block torch.compile: keys '0._orig_mod.weight'
        for i in (0, 2, 4):
            model[i] = torch.compile(model[i], backend="eager")
    for m in model:
        if isinstance(m, nn.Linear) or kind == "compiled" and not isinstance(m, nn.ReLU):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if kind.startswith("torchao"):
        from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8
        # Eager: torch.compile of torchao's step over DTensors reuses one param's graph for another
        # (torch 2.13 + torchao, CPU). What is tested here is the state it leaves, not its speed.
        torch.compile = lambda fn, **kwargs: fn
        make = {"torchaofp8": AdamWFp8, "torchao4bit": AdamW4bit}.get(kind, AdamW8bit)
        opt = make(model.parameters(), lr=1e-2, weight_decay=0.1)
    elif kind == "groups":  # decay / no-decay groups, as Hugging Face's and nanoGPT's trainers make them
        ps = list(model.parameters())
        opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() > 1], "weight_decay": 0.1},
                                 {"params": [p for p in ps if p.dim() <= 1], "weight_decay": 0.0}], lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=kind == "amsgrad")
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(4, 64, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    os.makedirs(out, exist_ok=True)
    torch.save(model.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
    if kind == "fqn":  # keyed by name, as get_optimizer_state_dict gives it (DTensors still)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        torch.save(get_optimizer_state_dict(model, opt), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
    else:
        torch.save(opt.state_dict(), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
    torch.save({"lr_scheduler": None, "rng": torch.get_rng_state()}, f"{out}/extra_state_world_size_{world}_rank_{rank}.pt")
    # The reference: every rank's local state, as plain tensors, by name.
    names = {p: n for n, p in model.named_parameters()}
    local = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, DTensor):
                v = v.to_local()
            if hasattr(v, "dequantize"):
                v = v.dequantize()
            local[f"{names[p]}.{k}"] = v.detach().clone()
        local[f"{names[p]}.param"] = p.to_local().detach().clone()
    torch.save(local, f"{out}.local{rank}")
    if kind == "hsdp":  # torch's own gather (a collective), as the reference
        full = {f"{names[p]}.param": p.full_tensor() for p in model.parameters()}
        for p, st in opt.state.items():
            full.update({f"{names[p]}.{k}": (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in st.items()})
        if rank == 0:
            torch.save(full, f"{out}.full")
    if kind in ("adamw", "amsgrad", "frozen", "compiled"):  # torch's own gather of the whole state, for a resume elsewhere
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
        o = StateDictOptions(full_state_dict=True, cpu_offload=True)
        whole = {"model": get_model_state_dict(model, options=o), "optim": get_optimizer_state_dict(model, opt, options=o)}
        if rank == 0:
            torch.save(whole, f"{out}.whole")
    if kind.startswith("torchao"):  # the same state as a DCP, as torchtitan saves it
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}.dcp")
    # together (the rare gloo abort in the teardown is retried by the runner)
    dist.barrier()
    dist.destroy_process_group()
""")


def fsdp_run(tmp_path, kind, world):
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP_SCRIPT)
    out = tmp_path / f"{kind}{world}"
    run_on_ranks(world, kind, out, script=script)
    return out


def reference(out, world):
    """Every rank's local tensors put together by rows, as FSDP2 shards them."""
    locals_ = [torch.load(f"{out}.local{r}") for r in range(world)]
    full = {}
    for key in locals_[0]:
        parts = [l[key] for l in locals_]
        full[key] = parts[0] if key.endswith(".step") else torch.cat([p.reshape(-1, *parts[0].shape[1:]) for p in parts])
    return full


@pytest.mark.parametrize("kind,world", [("adamw", 3), ("amsgrad", 4), ("adamw", 1), ("hsdp", 4), ("fqn", 2),
                                        ("groups", 2)])
def test_fsdp2_rank_files_read_as_one_state_by_name(tmp_path, optstate_cli, kind, world):
    out = fsdp_run(tmp_path, kind, world)
    full = torch.load(f"{out}.full") if kind == "hsdp" else reference(out, world)
    inspect = optstate_cli("inspect", out, "--json")
    doc = json.loads(inspect.stdout)
    assert doc["format"] == "torchsave" and doc["ranks"] == world, doc["ranks"]
    header = optstate_cli("inspect", out, "--no-stats").stdout.splitlines()[0]
    assert header.endswith(f"(torchsave, files of {world} rank{'s' if world > 1 else ''})"), header
    # Names from the model's files (the optimizer's own state has only numbers), or the state's own
    # keys (get_optimizer_state_dict); weights carried.
    assert sorted(doc["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert any("extra_state_world_size" in line for line in doc["not_read"])
    assert optstate_cli("validate", out).returncode == 0

    # Converted to one torch.optim.AdamW file: every entry bit for bit what the ranks held.
    optstate_cli("convert", out, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    opt_sd, weights = plain["optimizer"], plain["model"]
    names = [n for g in opt_sd["param_groups"] for n in g["param_names"]]
    if kind == "groups":  # each group's params placed among the model's DTensors in order
        assert [g["param_names"] for g in opt_sd["param_groups"]] == [["0.weight", "2.weight", "4.weight"],
                                                                       ["0.bias", "2.bias", "4.bias"]]
    for i, name in enumerate(names):
        st = opt_sd["state"][i]
        assert torch.equal(st["step"], full[f"{name}.step"])
        for k in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kind == "amsgrad" else ()):
            assert torch.equal(st[k], full[f"{name}.{k}"]), (name, k)
        assert torch.equal(weights[name], full[f"{name}.param"]), name
    # ... which a plain (not sharded) model and torch.optim.AdamW take.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 33), torch.nn.ReLU(),
                                torch.nn.Linear(33, 5))
    model.load_state_dict(weights)
    if kind == "groups":
        named = list(model.named_parameters())
        opt = torch.optim.AdamW([{"params": [(n, p) for n, p in named if p.dim() > 1]},
                                 {"params": [(n, p) for n, p in named if p.dim() <= 1]}], lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2, amsgrad=kind == "amsgrad")
    opt.load_state_dict(opt_sd)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()

    # The same state hashes alike from the rank files and from the plain file.
    h = lambda p: optstate_cli("hash", p).stdout.strip().splitlines()[-1]
    assert h(out) == h(tmp_path / "plain.pt")
    if kind == "hsdp":  # per-rank files are written for another world size on a 1-D mesh only
        res = optstate_cli("reshard", out, tmp_path / "hsdp2", "--world-size", "2", "--format", "torchsave", check=False)
        assert res.returncode == 2 and "a DTensor on a 2-D device mesh" in res.stderr, res.stderr
        assert not (tmp_path / "hsdp2").exists() and not any(p.name.startswith(".hsdp2") for p in tmp_path.iterdir())


def test_torchao_8bit_fsdp2_rank_files_keep_their_codes(tmp_path, optstate_cli):
    pytest.importorskip("torchao")
    out = fsdp_run(tmp_path, "torchao", 2)
    full = reference(out, 2)
    doc = json.loads(optstate_cli("inspect", out, "--json").stdout)
    assert doc["optimizer"] == "adamw8bit"
    enc = {n: {k: e["encoding"] for k, e in p["entries"].items()} for n, p in doc["params"].items()}
    # 128x64 over 2 ranks: 4096 elements a rank, quantized by torchao; the small ones stay plain;
    # 129x128 is 8-bit on rank 1 only, so it is read as fp32 values (rank 1's dequantized).
    assert enc["0.weight"]["exp_avg"] == "blockwise8" and enc["2.bias"]["exp_avg"] == "dense"
    assert enc["2.weight"]["exp_avg"] == "dense" and doc["params"]["2.weight"]["entries"]["exp_avg"]["dtype"] == "f32"
    assert any("8-bit encoding of 2.weight.exp_avg" in line for line in doc["not_read"])
    # Kept as 8-bit in a native checkpoint; dequantized into a plain file; both agree by value.
    optstate_cli("convert", out, tmp_path / "native")
    optstate_cli("convert", out, tmp_path / "plain.pt")
    hv = lambda p: optstate_cli("hash", "--values", p).stdout.strip().splitlines()[-1]
    assert hv(tmp_path / "native") == hv(tmp_path / "plain.pt") == hv(out)
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)["optimizer"]
    for i, name in enumerate(plain["param_groups"][0]["param_names"]):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain["state"][i][k], full[f"{name}.{k}"]), (name, k)

    # The DCP of the same state (8-bit chunks for some ranks of 2.weight, plain for others) reads
    # as the same values, and hashes as the rank files do.
    dcp_dir = f"{out}.dcp"
    doc = json.loads(optstate_cli("inspect", dcp_dir, "--json").stdout)
    assert doc["params"]["0.weight"]["entries"]["exp_avg"]["encoding"] == "blockwise8"
    assert doc["params"]["2.weight"]["entries"]["exp_avg"]["encoding"] == "dense"
    assert hv(dcp_dir) == hv(out)
    h = lambda p: optstate_cli("hash", p).stdout.strip().splitlines()[-1]
    assert h(dcp_dir) == h(out)
    assert optstate_cli("validate", dcp_dir).returncode == 0


@pytest.mark.parametrize("kind", ["torchaofp8", "torchao4bit"])
def test_torchao_fp8_and_4bit_fsdp2_rank_files_and_dcp_read_as_torchaos_dequantize(tmp_path, optstate_cli, kind):
    # AdamWFp8 (float8_e4m3fn codes, blocks of 256) and AdamW4bit (two codes a byte, a 16-entry map,
    # blocks of 128) on the ranks whose shards torchao quantized, plain fp32 elsewhere: read as fp32
    # values, bit for bit what torchao's own dequantize() gives, from the per-rank files and the DCP.
    out = fsdp_run(tmp_path, kind, 2)
    full = reference(out, 2)
    doc = json.loads(optstate_cli("inspect", out, "--json").stdout)
    assert doc["optimizer"] == "adamw"
    assert all(e["encoding"] == "dense" for p in doc["params"].values() for e in p["entries"].values())
    what = "float8" if kind == "torchaofp8" else "4-bit"
    assert any(f"{what} encoding of 0.weight.exp_avg" in line for line in doc["not_read"]), doc["not_read"]
    optstate_cli("convert", out, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)["optimizer"]
    for i, name in enumerate(plain["param_groups"][0]["param_names"]):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain["state"][i][k], full[f"{name}.{k}"]), (name, k)
    h = lambda p: optstate_cli("hash", p).stdout.strip().splitlines()[-1]
    assert h(f"{out}.dcp") == h(out) == h(tmp_path / "plain.pt")
    assert optstate_cli("validate", f"{out}.dcp").returncode == 0
    assert optstate_cli("validate", out).returncode == 0


RESUME_SCRIPT = textwrap.dedent("""
    # verl's load_checkpoint on another world size: each rank torch.loads its own model, optimizer and
    # extra_state files and loads them into FSDP2. Beside it, the same model and optimizer given the
    # saved run's whole state through torch's own resharding (set_state_dict), as the reference.
    import sys, torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
        get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kind, ckpt, whole, out = sys.argv[1:5]

    def build():
        torch.manual_seed(1)  # not the saved run's init: everything must come from the files
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 33), nn.ReLU(), nn.Linear(33, 5))
        if kind == "frozen":
            model[0].weight.requires_grad_(False)
        if kind == "compiled":
            for i in (0, 2, 4):
                model[i] = torch.compile(model[i], backend="eager")
        for m in model:
            if isinstance(m, nn.Linear) or kind == "compiled" and not isinstance(m, nn.ReLU):
                fully_shard(m)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=kind == "amsgrad")

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    def state(model, opt):  # copies: a step tensor is the optimizer's own, which the next step changes
        import copy
        return copy.deepcopy({"model": get_model_state_dict(model, options=full),
                              "optim": get_optimizer_state_dict(model, opt, options=full)})

    model, opt = build()
    model.load_state_dict(torch.load(f"{ckpt}/model_world_size_{world}_rank_{rank}.pt", weights_only=False))
    opt.load_state_dict(torch.load(f"{ckpt}/optim_world_size_{world}_rank_{rank}.pt", weights_only=False))
    extra = torch.load(f"{ckpt}/extra_state_world_size_{world}_rank_{rank}.pt", weights_only=False)
    torch.set_rng_state(extra["rng"])
    loaded = state(model, opt)
    ref_model, ref_opt = build()
    saved = torch.load(whole, weights_only=False)
    set_model_state_dict(ref_model, saved["model"], options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(ref_model, ref_opt, saved["optim"], options=StateDictOptions(full_state_dict=True))
    for m, o in ((model, opt), (ref_model, ref_opt)):  # one more step each, on the same data
        g = torch.Generator().manual_seed(1000 + rank)
        m(torch.randn(4, 64, generator=g)).square().sum().backward()
        o.step()
        o.zero_grad()
    after, ref_after = state(model, opt), state(ref_model, ref_opt)
    if rank == 0:
        torch.save({"loaded": loaded, "after": after, "ref_after": ref_after}, out)
    dist.barrier()
    dist.destroy_process_group()
""")


def assert_same_state(a, b, what):
    """Two {"model": ..., "optim": ...} whole state dicts (get_state_dict's, keyed by name) bit for bit."""
    assert a["model"].keys() == b["model"].keys(), what
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), (what, k)
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys(), what
    for name in sa:
        assert sa[name].keys() == sb[name].keys(), (what, name)
        for k in sa[name]:
            assert torch.equal(sa[name][k], sb[name][k]), (what, name, k)
    # (torch's set_optimizer_state_dict leaves betas a list where load_state_dict keeps the tuple)
    plain = lambda groups: [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]
    assert plain(a["optim"]["param_groups"]) == plain(b["optim"]["param_groups"]), what


@pytest.mark.parametrize("kind,n,m", [("adamw", 2, 3), ("frozen", 3, 2), ("amsgrad", 2, 1), ("adamw", 1, 2),
                                      ("compiled", 2, 3)])
def test_fsdp2_rank_files_resharded_resume_in_fsdp2_on_another_world_size(tmp_path, optstate_cli, kind, n, m):
    """verl saves FSDP2's state per rank and loads it only on the world size it saved. reshard
    --format torchsave writes those files for m ranks: verl's own loading steps take them on m ranks
    and hold the saved state bit for bit (as torch's set_state_dict of the whole state gives it),
    and the next step is the same too. The other files go along: the extra_state ones for each new
    rank, fsdp_config.json with the new world size, huggingface/ as it was. compiled: blocks
    compiled one by one as torchtitan does, the model files' keys '0._orig_mod.weight': the state
    names them '0.weight' as torch's state dicts do, the files written keep their own keys."""
    out = fsdp_run(tmp_path, kind, n)
    (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": n}))
    (out / "huggingface").mkdir()
    (out / "huggingface" / "config.json").write_text('{"architectures": ["Sequential"]}')
    dst = tmp_path / f"actor{m}"
    res = optstate_cli("reshard", out, dst, "--world-size", str(m), "--format", "torchsave")
    assert f"(torchsave, {m} rank" in res.stdout and "extra_state_world_size_" in res.stdout, res.stdout
    names = sorted(p.name for p in dst.iterdir())
    assert names == sorted([f"{f}_world_size_{m}_rank_{r}.pt" for f in ("model", "optim", "extra_state")
                            for r in range(m)] + ["fsdp_config.json", "huggingface"]), names
    assert json.loads((dst / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": m}
    assert (dst / "huggingface" / "config.json").read_text() == '{"architectures": ["Sequential"]}'
    for r in range(m):  # rank r's extra state is the saved run's rank r % n's
        assert (dst / f"extra_state_world_size_{m}_rank_{r}.pt").read_bytes() == \
            (out / f"extra_state_world_size_{n}_rank_{r % n}.pt").read_bytes()
    h = lambda p: optstate_cli("hash", p).stdout.strip().splitlines()[-1]
    assert h(dst) == h(out)
    assert optstate_cli("validate", dst).returncode == 0

    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    run_on_ranks(m, kind, dst, f"{out}.whole", tmp_path / "resumed.pt", script=script)
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    saved = torch.load(f"{out}.whole", weights_only=False)
    assert_same_state(got["loaded"], saved, "loaded")
    assert_same_state(got["after"], got["ref_after"], "after a step")
    if kind == "frozen":  # held by the optimizer, never stepped: no state, weights carried
        assert "0.weight" not in saved["optim"]["state"] and "0.weight" in saved["model"]
    if kind == "compiled":
        assert "0.weight.exp_avg" in optstate_cli("hash", dst).stdout
        assert "0._orig_mod.weight" in torch.load(dst / f"model_world_size_{m}_rank_0.pt", weights_only=False)


def test_missing_or_lone_rank_files_are_refused_by_name(tmp_path, optstate_cli):
    out = fsdp_run(tmp_path, "adamw", 3)
    # One rank's file alone is not the state.
    r = optstate_cli("inspect", out / "optim_world_size_3_rank_1.pt", check=False)
    assert r.returncode == 2 and "one rank's part; pass the directory" in r.stderr
    # A missing rank is named.
    os.rename(out / "optim_world_size_3_rank_2.pt", tmp_path / "moved.pt")
    r = optstate_cli("inspect", out, check=False)
    assert r.returncode == 2 and "rank 2's file optim_world_size_3_rank_2.pt is missing" in r.stderr
    os.rename(tmp_path / "moved.pt", out / "optim_world_size_3_rank_2.pt")
    # A damaged byte in one rank's moments fails its CRC-32, naming the file and tensor.
    path = out / "optim_world_size_3_rank_1.pt"
    raw = bytearray(path.read_bytes())
    info = zipfile.ZipFile(path).getinfo("optim_world_size_3_rank_1/data/3")  # exp_avg_sq of '0.weight'
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    raw[info.header_offset + 30 + name_len + extra_len + 100] ^= 0x10
    path.write_bytes(bytes(raw))
    r = optstate_cli("validate", out, check=False)
    assert r.returncode == 1 and "optim_world_size_3_rank_1.pt: tensor '0.weight.exp_avg_sq'" in r.stdout
    assert "CRC-32" in r.stdout
    # The directory is a training run's folder: a write with --overwrite leaves it as it is.
    before = sorted(os.listdir(out))
    r = optstate_cli("convert", out / "optim_world_size_3_rank_0.pt", out, "--overwrite", check=False)
    assert r.returncode == 2 and sorted(os.listdir(out)) == before


FSDP1_MODEL = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import ShardedStateDictConfig, ShardedOptimStateDictConfig
    from torch.distributed.fsdp import FullStateDictConfig, FullOptimStateDictConfig
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    orig, amsgrad, tied = sys.argv[1] == "orig", sys.argv[2] == "amsgrad", sys.argv[2] == "tied"
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(16, 7), nn.LayerNorm(7), nn.Linear(7, 16, bias=False)

        def forward(self, x):
            return x + self.b(self.norm(torch.relu(self.a(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.layers, self.head = nn.Embedding(11, 16), nn.ModuleList([Block(), Block()]), nn.Linear(16, 5)
            if tied:  # the head tied to the embedding, as small Qwen and Llama models have it
                self.head = nn.Linear(16, 11, bias=False)
                self.head.weight = self.emb.weight

        def forward(self, x):
            x = self.emb(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)


    def wrap(module):
        return FSDP(module, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig,
                    device_mesh=init_device_mesh("cpu", (world,)), device_id=torch.device("cpu"))
""")

FSDP1_SCRIPT = FSDP1_MODEL + textwrap.dedent("""
    # FSDP1 (FullyShardedDataParallel) saved as verl's FSDP strategy saves it: under
    # SHARDED_STATE_DICT, each rank's model.state_dict() (DTensors: FSDP built with a device_mesh)
    # and optimizer.state_dict() (plain 1-D parts of flat parameters). Transformer-like blocks
    # wrapped as units, the embedding and head in the root's unit; sizes that leave padding.
    out = sys.argv[3]
    model = wrap(Model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randint(0, 11, (4, 3), generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    os.makedirs(out, exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        torch.save(model.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
        torch.save(opt.state_dict(), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
    # The reference, independent of how optstate finds it: each rank's runs of each param, placed by
    # FSDP's own flat-parameter metadata (where a run starts in the param and in this rank's part).
    runs = []
    for name, mod in model.named_modules():
        if not isinstance(mod, FSDP) or mod._handle is None:
            continue
        flat = mod._handle.flat_param
        prefix = clean_tensor_name(name)
        for fqn, info, p in zip(flat._fqns, flat._shard_param_infos, flat._params or [None] * len(flat._fqns)):
            if info.in_shard:
                st = opt.state[p] if orig else opt.state[flat]
                lo = 0 if orig else info.offset_in_shard
                moments = {k: v.reshape(-1)[lo:lo + info.numel_in_shard].clone() for k, v in st.items() if k != "step"}
                runs.append(((prefix + "." if prefix else "") + fqn, info.intra_param_start_idx, moments, float(st["step"])))
    torch.save(runs, f"{out}.runs{rank}")
    # torch's own gather of the weights (its FULL optimizer state dict of use_orig_params is not
    # used: on CPU, torch 2.13 gives exp_avg_sq's values for exp_avg there)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                              FullOptimStateDictConfig(rank0_only=True)):
        weights = model.state_dict()
    if rank == 0:
        torch.save(weights, f"{out}.weights")
    if not orig:  # torch's own gather of the whole state, for a resume elsewhere
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                                  FullOptimStateDictConfig(rank0_only=True)):
            whole = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            torch.save({"model": weights, "optim": whole}, f"{out}.whole")
    # together (the rare gloo abort in the teardown is retried by the runner)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("mode,kind,world", [("flat", "adamw", 3), ("orig", "adamw", 3), ("flat", "amsgrad", 2),
                                             ("orig", "amsgrad", 4), ("orig", "adamw", 2), ("flat", "tied", 3),
                                             ("orig", "tied", 2), ("flat", "adamw", 1), ("orig", "adamw", 1)])
def test_fsdp1_rank_files_read_as_one_state_by_name(tmp_path, optstate_cli, mode, kind, world):
    """verl's FSDP (FSDP1) checkpoint: every rank's optimizer.state_dict() holds 1-D parts of flat
    parameters -- one per FSDP unit (use_orig_params=False, verl's default), or one per param with
    a run of it or nothing on each rank (use_orig_params=True) -- beside model files of DTensors.
    optstate names and places every element; checked against where FSDP's own metadata puts each
    rank's run, and the weights against torch's gather. A tied head is one param (the embedding's
    name), as FSDP flattens it once; the model files hold it twice."""
    script = tmp_path / "fsdp1.py"
    script.write_text(FSDP1_SCRIPT)
    out = tmp_path / f"{mode}{kind}{world}"
    run_on_ranks(world, mode, kind, out, script=script)
    doc = json.loads(optstate_cli("inspect", out, "--json").stdout)
    assert doc["format"] == "torchsave" and len(doc["params"]) == (11 if kind == "tied" else 13)
    assert ("head.weight" in doc["params"]) == (kind != "tied")
    assert not any("without state" in line for line in doc["not_read"]), doc["not_read"]
    optstate_cli("validate", out)
    optstate_cli("convert", out, tmp_path / "plain.safetensors")
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "plain.safetensors"))
    checked = 0
    for r in range(world):
        for name, start, moments, step in torch.load(f"{out}.runs{r}"):
            for k, v in moments.items():
                assert torch.equal(got[f"{name}.{k}"].reshape(-1)[start:start + v.numel()], v), (name, k, r)
                checked += v.numel()
    moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if kind == "amsgrad" else ("exp_avg", "exp_avg_sq")
    assert checked == sum(got[f"{n}.{k}"].numel() for n in doc["params"] for k in moments)  # every element
    for name, w in torch.load(f"{out}.weights").items():
        assert torch.equal(got[f"{name}.param"], w) if name in doc["params"] else name == "head.weight", name
    # as plain torch state: it loads into torch.optim.AdamW over the unwrapped model
    optstate_cli("convert", out, tmp_path / "plain.pt")
    sd = torch.load(tmp_path / "plain.pt")
    assert sd["optimizer"]["param_groups"][0]["param_names"][0] == "emb.weight"


FSDP1_RESUME = FSDP1_MODEL + textwrap.dedent("""
    # verl's load_checkpoint (FSDP1) on another world size: under SHARDED_STATE_DICT each rank loads its
    # own model file (DTensors) and optimizer file (its parts of the flat parameters). Beside it, the
    # same model given the saved run's whole state through FSDP's own resharding
    # (FSDP.optim_state_dict_to_load), as the reference; then one more step each on the same data.
    import copy
    ckpt, whole, out = sys.argv[3:6]
    full = lambda m: FSDP.state_dict_type(m, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                                          FullOptimStateDictConfig(rank0_only=False))
    def state(m, o):
        with full(m):
            return copy.deepcopy({"model": m.state_dict(), "optim": FSDP.optim_state_dict(m, o)})

    model = wrap(Model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        model.load_state_dict(torch.load(f"{ckpt}/model_world_size_{world}_rank_{rank}.pt", weights_only=False))
        opt.load_state_dict(torch.load(f"{ckpt}/optim_world_size_{world}_rank_{rank}.pt", weights_only=False))
    loaded = state(model, opt)
    ref = wrap(Model())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    saved = torch.load(whole, weights_only=False)
    with full(ref):
        ref.load_state_dict(saved["model"])
        ref_opt.load_state_dict(FSDP.optim_state_dict_to_load(ref, ref_opt, saved["optim"]))
    for m, o in ((model, opt), (ref, ref_opt)):
        g = torch.Generator().manual_seed(1000 + rank)
        m(torch.randint(0, 11, (4, 3), generator=g)).square().sum().backward()
        o.step()
        o.zero_grad()
    after, ref_after = state(model, opt), state(ref, ref_opt)
    if rank == 0:
        torch.save({"loaded": loaded, "after": after, "ref_after": ref_after}, out)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("kind,n,m", [("adamw", 2, 3), ("tied", 3, 2), ("amsgrad", 2, 1)])
def test_fsdp1_rank_files_resharded_resume_in_fsdp1_on_another_world_size(tmp_path, optstate_cli, kind, n, m):
    """verl's default strategy (FSDP1, flat parameters) saved on n ranks, written by reshard --format
    torchsave for m: each rank's part of every flat parameter (FSDP's padding zeros) and of every
    DTensor. FSDP1 loads them through verl's own steps on m ranks and holds the saved state bit for bit
    (as FSDP's own resharding of the whole state gives it), and the next step is the same too."""
    script = tmp_path / "fsdp1.py"
    script.write_text(FSDP1_SCRIPT)
    out = tmp_path / f"flat{kind}{n}"
    run_on_ranks(n, "flat", kind, out, script=script)
    dst = tmp_path / f"actor{m}"
    optstate_cli("reshard", out, dst, "--world-size", str(m), "--format", "torchsave")
    assert sorted(p.name for p in dst.iterdir()) == sorted(f"{f}_world_size_{m}_rank_{r}.pt" for f in ("model", "optim")
                                                           for r in range(m))
    h = lambda p: optstate_cli("hash", p).stdout.strip().splitlines()[-1]
    assert h(dst) == h(out)
    script = tmp_path / "resume.py"
    script.write_text(FSDP1_RESUME)
    run_on_ranks(m, "flat", kind, dst, f"{out}.whole", tmp_path / "resumed.pt", script=script)
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    saved = torch.load(f"{out}.whole", weights_only=False)
    assert_same_state(got["loaded"], saved, "loaded")
    assert_same_state(got["after"], got["ref_after"], "after a step")


def test_fsdp1_rank_files_that_do_not_add_up_are_refused_by_name(tmp_path, optstate_cli):
    script = tmp_path / "fsdp1.py"
    script.write_text(FSDP1_SCRIPT)
    out = tmp_path / "flat"
    run_on_ranks(2, "flat", "adamw", out, script=script)
    # a param gone from the model's files: the units no longer split its params
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    for r in range(2):
        sd = torch.load(bad / f"model_world_size_2_rank_{r}.pt", weights_only=False)
        del sd["layers.1.norm.bias"]
        torch.save(sd, bad / f"model_world_size_2_rank_{r}.pt")
    err = optstate_cli("inspect", bad, check=False)
    assert err.returncode == 2 and "do not split into the optimizer's 3 FSDP units" in err.stderr, err.stderr
    # a rank's model file missing
    os.remove(bad / "model_world_size_2_rank_1.pt")
    err = optstate_cli("inspect", bad, check=False)
    assert err.returncode == 2 and "rank 1's model file model_world_size_2_rank_1.pt is missing" in err.stderr, err.stderr
