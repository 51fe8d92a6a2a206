"""Sharded (multi-rank) save/load through the Python face, over torch.distributed gloo on loopback.

The sample samples/train_sharded.py trains ZeRO-1 style: every rank steps its ranges, saves them in
parallel and, after a resume on any number of ranks, checks its live shard against the checkpoint.
An uninterrupted run and runs resumed on another number of ranks must end with the same hash.
"""
import os
import sys
import textwrap

import pytest
import torch

import optstate

from conftest import REPO
from launch import run_ranks_past_gloo_aborts


def run_on_ranks(n, *args, script=None, cwd=None):
    """Runs `script` (samples/train_sharded.py by default) with `args` on n local ranks (launch.py);
    a failure fails the test with the ranks' output. Returns their stdout."""
    cmd = [sys.executable, str(script or REPO / "samples" / "train_sharded.py"), *map(str, args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests" / "python"),
                                                                   os.environ.get("PYTHONPATH")])))
    proc = run_ranks_past_gloo_aborts(cmd, n, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{n} ranks of {' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def root(optstate_cli, path):
    return optstate_cli("hash", path).stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("opt", ["adamw", "adamw8bit"])
def test_resume_on_other_world_sizes_is_bitwise(tmp_path, optstate_cli, opt):
    run_on_ranks(1, "--optimizer", opt, "--steps", 12, "--save", tmp_path / "full")
    run_on_ranks(2, "--optimizer", opt, "--steps", 6, "--save", tmp_path / "two")
    assert sorted(os.listdir(tmp_path / "two" / "data")) == ["rank-00000.bin", "rank-00001.bin"]
    optstate_cli("validate", tmp_path / "two")
    out = run_on_ranks(3, "--optimizer", opt, "--steps", 6, "--resume", tmp_path / "two", "--save", tmp_path / "three")
    assert "every rank's live shard equals the checkpoint" in out
    assert root(optstate_cli, tmp_path / "three") == root(optstate_cli, tmp_path / "full")
    # ... and back down to one rank, from the 3-rank checkpoint, also matches a longer run.
    run_on_ranks(1, "--optimizer", opt, "--steps", 18, "--save", tmp_path / "full18")
    run_on_ranks(4, "--optimizer", opt, "--steps", 6, "--resume", tmp_path / "three", "--save", tmp_path / "four")
    assert root(optstate_cli, tmp_path / "four") == root(optstate_cli, tmp_path / "full18")


DDP_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, optstate
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 130), torch.nn.Linear(130, 3))
    opt = getattr(optstate, sys.argv[1])(model.parameters(), lr=1e-2)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 40, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    optstate.save(sys.argv[2], model, opt)
    # Every rank loads the whole (replicated) state back and it is the live one.
    fresh = torch.nn.Sequential(torch.nn.Linear(40, 130), torch.nn.Linear(130, 3))
    opt2 = getattr(optstate, sys.argv[1])(fresh.parameters(), lr=1e-2)
    optstate.load(sys.argv[2], fresh, opt2)
    assert optstate.verify(sys.argv[2], fresh, opt2) == []
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    # together: torch 2.13 + gloo aborts now and then (SIGABRT) when one rank destroys its group early
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("opt", ["FusedAdamW", "AdamW8bit"])
def test_replicated_model_saves_in_parallel_like_one_process(tmp_path, optstate_cli, opt):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    run_on_ranks(1, opt, tmp_path / "one", script=script)
    run_on_ranks(3, opt, tmp_path / "three", script=script)
    assert len(os.listdir(tmp_path / "three" / "data")) == 3
    assert root(optstate_cli, tmp_path / "three") == root(optstate_cli, tmp_path / "one")


def test_verify_names_what_differs_after_a_load(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 2))
    shards = optstate.ShardedParams(model, block_size=64)
    opt = optstate.AdamW8bit(shards.parameters(), block_size=64)
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
        shards.scatter_grads()
        opt.step()
        shards.gather_params()
    optstate.save(tmp_path / "ck", shards, opt)
    assert optstate.verify(tmp_path / "ck", shards, opt) == []
    first = shards.parameters()[0]
    opt.state[first]["exp_avg_codes"].view(-1)[7] ^= 1
    opt.state[first]["step"] += 1
    problems = optstate.verify(tmp_path / "ck", shards, opt)
    assert len(problems) == 2, problems
    assert "param '0.weight': step live 3" in problems[0]
    assert "'0.weight.exp_avg' codes (rank 0 of 1): differs" in problems[1] and "element 7" in problems[1]


CORRUPT_RANK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist, optstate
    from pathlib import Path
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ck = dist.get_rank(), Path(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 2))
    shards = optstate.ShardedParams(model)
    opt = optstate.FusedAdamW(shards.parameters(), lr=1e-2)
    def train(steps):
        for step in range(steps):
            model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).sum().backward()
            shards.scatter_grads()
            opt.step()
            shards.gather_params()
            model.zero_grad()
    train(2)
    optstate.save(ck, shards, opt)
    dist.barrier()
    if rank == 0:  # one byte of an exp_avg chunk in rank 1's file: only rank 1 reads it
        manifest = json.loads((ck / "manifest.json").read_text())
        f1 = [i for i, f in enumerate(manifest["files"]) if f["path"].endswith("rank-00001.bin")][0]
        chunk = [c for c in manifest["params"]["0.weight"]["entries"]["exp_avg"]["components"]["values"]
                 if c["file"] == f1][0]
        data = ck / manifest["files"][f1]["path"]
        raw = bytearray(data.read_bytes())
        raw[chunk["offset"]] ^= 0x40
        data.write_bytes(bytes(raw))
    dist.barrier()
    train(1)
    weights = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in shards.parameters()]
    try:
        optstate.load(ck, shards, opt)
        print(f"rank {rank}: loaded")
    except Exception as e:
        print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0]}")
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), weights)) and all(
        all(torch.equal(opt.state[p][k], v) for k, v in st.items()) for p, st in zip(shards.parameters(), state))
    print(f"rank {rank}: unchanged={same}")
    # together: torch 2.13 + gloo aborts now and then (SIGABRT) when one rank destroys its group early
    dist.barrier()
    dist.destroy_process_group()
""")


def test_sharded_load_with_a_corrupt_chunk_on_one_rank_changes_no_rank(tmp_path):
    script = tmp_path / "corrupt.py"
    script.write_text(CORRUPT_RANK_SCRIPT)
    out = run_on_ranks(2, tmp_path / "ck", script=script)
    assert "rank 1: RuntimeError: optstate: " in out and "checksum mismatch" in out, out
    assert "rank 0: RuntimeError: optstate.load: another rank could not load" in out, out
    assert "rank 0: unchanged=True" in out and "rank 1: unchanged=True" in out, out


FSDP2_TRAIN_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp, optstate
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = sys.argv[1]
    kw = dict(lr=1e-3, weight_decay=0.05, amsgrad=True)
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 3))
    def train(model, opt):
        for step in range(3):  # the same batch on every rank: FSDP2's averaged grads are the batch's
            g = torch.Generator().manual_seed(step)
            model(torch.randn(8, 64, generator=g)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    model = build()
    fully_shard(model)
    opt = optstate.FusedAdamW(model.parameters(), **kw)
    train(model, opt)
    assert all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in model.parameters())
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    optstate.save(out + ".native", model, opt)  # each rank writes its rows in parallel
    # The same run without FSDP2 (on every rank, same thread count): the reference, saved DDP-style.
    ref_model = build()
    ref_opt = optstate.FusedAdamW(ref_model.parameters(), **kw)
    train(ref_model, ref_opt)
    optstate.save(out + ".ref", ref_model, ref_opt)
    # Resume: a fresh FSDP2 model loads its rows of the native checkpoint; both continue equally.
    torch.manual_seed(5)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 3))
    fully_shard(fresh)
    fresh_opt = optstate.FusedAdamW(fresh.parameters(), amsgrad=True)
    optstate.load(out + ".native", fresh, fresh_opt)
    assert optstate.verify(out + ".native", fresh, fresh_opt) == []
    assert all(isinstance(fresh_opt.state[p]["exp_avg"], DTensor) for p in fresh.parameters())
    train(model, opt)
    train(fresh, fresh_opt)
    assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters()))
    print("resumed bitwise")
    if dist.get_rank() == 0:
        ref = {}
        for name, p in ref_model.named_parameters():
            ref[name + ".param"] = p.detach().clone()
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                ref[name + "." + k] = ref_opt.state[p][k].clone()
        torch.save(ref, out + ".ref.pt")
    # together: torch 2.13 + gloo aborts now and then (SIGABRT) when one rank destroys its group early
    dist.barrier()
    dist.destroy_process_group()
""")


def test_fsdp2_training_with_fused_adamw_saves_loads_and_resumes(tmp_path, optstate_cli):
    """FSDP2 (what torchtitan, verl and prime-rl shard with): FusedAdamW steps DTensor params shard by
    shard with DTensor moments. torch's get_state_dict + dcp.save write it, and so does optstate.save
    (each rank its rows, in parallel); both hash like the run without FSDP2. A fresh FSDP2 model
    resumes from optstate's checkpoint bit for bit, and the DCP loads into one process bit for bit."""
    script = tmp_path / "fsdp2_train.py"
    script.write_text(FSDP2_TRAIN_SCRIPT)
    ck = tmp_path / "dcp"
    out = run_on_ranks(2, ck, script=script)
    assert out.count("resumed bitwise") == 2, out
    native = tmp_path / "dcp.native"
    assert sorted(os.listdir(native / "data")) == ["rank-00000.bin", "rank-00001.bin"]
    for c in (ck, native):
        optstate_cli("validate", c)
    # Same state, same hash, whatever wrote it: FSDP2 via DCP, FSDP2 via optstate.save, no FSDP2.
    assert root(optstate_cli, ck) == root(optstate_cli, native) == root(optstate_cli, tmp_path / "dcp.ref")
    ref = torch.load(str(ck) + ".ref.pt")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.GELU(), torch.nn.Linear(97, 3))
    opt = optstate.FusedAdamW(model.parameters(), amsgrad=True)
    optstate.load(ck, model, opt)
    assert opt.param_groups[0]["weight_decay"] == 0.05
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[name + ".param"]), name
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert torch.equal(opt.state[p][k], ref[name + "." + k]), (name, k)
        assert opt.state[p]["step"].item() == 3
    assert optstate.verify(ck, model, opt) == []


FSDP2_8BIT_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp, optstate
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from dist_checks import same_run
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = sys.argv[1]
    kw = dict(lr=1e-3, weight_decay=0.05, block_size=64)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(64, 256)   # weight: rows of 64 = one block each; bias dense
            self.b = torch.nn.Linear(256, 128)  # weight: rows of 4 blocks
            # weight [33, 128]: ranks hold 17 and 16 rows (34 and 32 blocks), not 33 blocks each
            self.c = torch.nn.Linear(128, 33)
            self.gain = torch.nn.Parameter(torch.randn(8192))  # 1-d: 4096 per rank = 64 blocks

        def forward(self, x):
            h = torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x))))
            return self.c(h).square().sum() + 1e-3 * self.gain.square().sum()

    def train(model, opt, steps=4):
        for step in range(steps):  # the same batch on every rank: FSDP2's averaged grads are the batch's
            g = torch.Generator().manual_seed(step)
            model(torch.randn(8, 64, generator=g)).backward()
            opt.step()
            opt.zero_grad()

    model = Net()
    fully_shard(model)
    opt = optstate.AdamW8bit(model.parameters(), **kw)
    train(model, opt)
    st = opt.state[model.a.weight]
    assert isinstance(st["exp_avg_codes"], DTensor) and isinstance(st["exp_avg_absmax"], DTensor)
    assert "exp_avg" in opt.state[model.a.bias]  # 256 elements: dense fp32, a DTensor like the param
    ref = Net()
    ref_opt = optstate.AdamW8bit(ref.parameters(), **kw)
    train(ref, ref_opt)
    same = True
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        same &= torch.equal(p.full_tensor(), q.detach())
        a, b = opt.state[p], ref_opt.state[q]
        for k in b:
            x = a[k].full_tensor() if isinstance(a[k], DTensor) else a[k]
            same &= torch.equal(x.reshape(-1), b[k].reshape(-1))
    print("fsdp2 == unsharded" if same else "fsdp2 differs")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    optstate.save(out + ".ref", ref, ref_opt)  # the unsharded run, every rank its share
    # Resume as torchtitan does: a fresh FSDP2 model and optimizer, dcp.load + set_state_dict; then
    # both runs continue equally.
    from torch.distributed.checkpoint.state_dict import set_state_dict
    torch.manual_seed(9)
    fresh = Net()
    fully_shard(fresh)
    fresh_opt = optstate.AdamW8bit(fresh.parameters(), **kw)
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    loaded = {"model": fmsd, "optim": fosd}
    dcp.load(loaded, checkpoint_id=out)
    set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    # ... and optstate's way: each rank writes its rows (on blocks) in parallel; a fresh model loads.
    optstate.save(out + ".native", model, opt)
    torch.manual_seed(7)
    back = Net()
    fully_shard(back)
    back_opt = optstate.AdamW8bit(back.parameters(), **kw)
    optstate.load(out + ".native", back, back_opt)
    assert optstate.verify(out + ".native", back, back_opt) == []
    assert isinstance(back_opt.state[back.a.weight]["exp_avg_absmax"], DTensor)

    for m_, o_ in ((model, opt), (fresh, fresh_opt), (back, back_opt)):
        train(m_, o_, 2)
    print("dcp resume bitwise" if same_run(model, opt, fresh, fresh_opt) else "dcp resume differs")
    print("native resume bitwise" if same_run(model, opt, back, back_opt) else "native resume differs")
    bad = torch.nn.Linear(100, 97)  # rows of 100 elements: blocks of 64 would straddle ranks
    fully_shard(bad)
    bad_opt = optstate.AdamW8bit(bad.parameters(), **kw)
    bad(torch.randn(2, 100)).sum().backward()
    try:
        bad_opt.step()
    except NotImplementedError as e:
        assert "[97, 100]" in str(e) and "block_size" in str(e) and "min_8bit_size" in str(e), e
        print("misaligned refused")
    # together: torch 2.13 + gloo aborts now and then (SIGABRT) when one rank destroys its group early
    dist.barrier()
    dist.destroy_process_group()
""")


def test_fsdp2_training_with_adamw8bit_equals_unsharded_saves_loads_and_resumes(tmp_path, optstate_cli):
    """AdamW8bit under FSDP2: each rank steps its rows with codes and scales sharded like them, which
    equals the unsharded run bit for bit (params, codes, scales, dense moments). get_state_dict +
    dcp.save write it and dcp.load + set_state_dict resume it (torchtitan's way); optstate.save
    writes it too (each rank its rows) and optstate.load resumes it; both resumes continue bit for
    bit, and both checkpoints hash like the unsharded run. Layouts whose blocks would straddle
    ranks are refused with the ways out."""
    script = tmp_path / "fsdp2_8bit.py"
    script.write_text(FSDP2_8BIT_SCRIPT)
    ck = tmp_path / "dcp8"
    out = run_on_ranks(2, ck, script=script)
    assert out.count("fsdp2 == unsharded") == 2, out
    assert out.count("dcp resume bitwise") == 2, out
    assert out.count("native resume bitwise") == 2, out
    native = tmp_path / "dcp8.native"
    assert sorted(os.listdir(native / "data")) == ["rank-00000.bin", "rank-00001.bin"]
    optstate_cli("validate", native)
    assert out.count("misaligned refused") == 2, out
    optstate_cli("validate", ck)
    info = optstate_cli("inspect", ck).stdout
    assert "adamw8bit" in info and "8bit/64 dynamic-signed" in info
    assert root(optstate_cli, ck) == root(optstate_cli, native) == root(optstate_cli, tmp_path / "dcp8.ref")


HSDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp, optstate
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dist_checks import same_run
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = sys.argv[1]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(64, 256)   # weight: rows of one block of 64; bias dense
            self.b = torch.nn.Linear(256, 128)  # weight: rows of 4 blocks
            self.c = torch.nn.Linear(128, 33)   # weight [33, 128]: the two shards hold 17 and 16 rows
            self.gain = torch.nn.Parameter(torch.randn(8192))  # 1-d: 4096 per shard = 64 blocks

        def forward(self, x):
            h = torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x))))
            return self.c(h).square().sum() + 1e-3 * self.gain.square().sum()

    def train(model, opt, steps, first=0):
        for step in range(first, first + steps):  # the same batch everywhere: averaged grads are the batch's
            g = torch.Generator().manual_seed(step)
            model(torch.randn(8, 64, generator=g)).backward()
            opt.step()
            opt.zero_grad()

    kinds = {"adamw": lambda ps: optstate.FusedAdamW(ps, lr=1e-3, weight_decay=0.05, amsgrad=True),
             "adamw8bit": lambda ps: optstate.AdamW8bit(ps, lr=1e-3, weight_decay=0.05, block_size=64)}
    for kind, make in kinds.items():
        model = Net()
        fully_shard(model, mesh=mesh)
        assert model.b.weight.placements[0].is_replicate() and model.b.weight.placements[1].is_shard(0)
        opt = make(model.parameters())
        train(model, opt, 3)
        ref = Net()
        ref_opt = make(ref.parameters())
        train(ref, ref_opt, 3)
        print(f"{kind} " + ("hsdp == unsharded" if same_run(model, opt, ref, ref_opt) else "hsdp differs"), flush=True)
        path = f"{out}.{kind}"
        optstate.save(path, model, opt)
        optstate.save(path + ".ref", ref, ref_opt)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path + ".dcp")
        torch.manual_seed(7)
        back = Net()
        fully_shard(back, mesh=mesh)
        back_opt = make(back.parameters())
        optstate.load(path, back, back_opt)
        assert optstate.verify(path, back, back_opt) == []
        # torch's DCP of the same run loads the same way, each replica reading its rows
        from_dcp = Net()
        fully_shard(from_dcp, mesh=mesh)
        from_dcp_opt = make(from_dcp.parameters())
        optstate.load(path + ".dcp", from_dcp, from_dcp_opt)
        print(f"{kind} " + ("dcp load == native load" if same_run(back, back_opt, from_dcp, from_dcp_opt)
                            else "dcp load differs"), flush=True)
        train(model, opt, 2, first=3)
        train(back, back_opt, 2, first=3)
        print(f"{kind} " + ("native resume bitwise" if same_run(model, opt, back, back_opt) else "native resume differs"),
              flush=True)
        # A failed writer fails the save on every rank, the replicas that write nothing included.
        if kind == "adamw" and dist.get_rank() == 0:
            os.makedirs(out + ".taken")
            open(out + ".taken/keep.txt", "w").close()
        dist.barrier()
        try:
            optstate.save(out + ".taken", model, opt)
        except (ValueError, RuntimeError) as e:
            if mesh.get_coordinate()[0] == 0:
                assert "keep.txt" in str(e) or "not empty" in str(e) or "taken" in str(e), e
            else:
                assert "a writing rank failed" in str(e), e
            print(f"{kind} failed save raised", flush=True)
    # Params sharded over different meshes: no single layout of shard ranks; refused on every rank.
    mixed = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fully_shard(mixed[0], mesh=init_device_mesh("cpu", (4,)))
    fully_shard(mixed[1], mesh=mesh)
    try:
        optstate.save(out + ".mixed", mixed, optstate.FusedAdamW(mixed.parameters()))
    except NotImplementedError as e:
        assert "same ranks" in str(e), e
        print("mixed meshes refused", flush=True)
    # together: torch 2.13 + gloo aborts now and then (SIGABRT) when one rank destroys its group early
    dist.barrier()
    dist.destroy_process_group()
""")


def test_hsdp_training_saves_once_per_row_range_loads_on_every_replica_and_resumes(tmp_path, optstate_cli):
    """HSDP (fully_shard on a (replicate, shard) mesh, torchtitan's multi-node layout) on 4 ranks as
    2 x 2: both optimizers step it bit for bit like the unsharded run; optstate.save writes the rows
    once (the first replica's two ranks, each its rows), every replica loads its rows back (from it
    and from torch's DCP of the run alike) and resumes bit for bit; the checkpoint, torch's DCP of the same run and the unsharded run's hash
    alike. A writer's failure fails the save on every rank."""
    script = tmp_path / "hsdp.py"
    script.write_text(HSDP_SCRIPT)
    ck = tmp_path / "hsdp"
    out = run_on_ranks(4, ck, script=script)
    for kind in ("adamw", "adamw8bit"):
        for what in ("hsdp == unsharded", "native resume bitwise", "dcp load == native load", "failed save raised"):
            assert out.count(f"{kind} {what}") == 4, (kind, what, out)
        native = tmp_path / f"hsdp.{kind}"
        assert sorted(os.listdir(native / "data")) == ["rank-00000.bin", "rank-00001.bin"]
        optstate_cli("validate", native)
        dcp_ck = tmp_path / f"hsdp.{kind}.dcp"
        assert root(optstate_cli, native) == root(optstate_cli, dcp_ck) == root(optstate_cli, tmp_path / f"hsdp.{kind}.ref")
    assert os.listdir(tmp_path / "hsdp.taken") == ["keep.txt"]
    assert out.count("mixed meshes refused") == 4, out
    assert not (tmp_path / "hsdp.mixed").exists()


TP_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, optstate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Linear(16, 32)
    # TP's RowwiseParallel layout: columns per rank, not a range of the flattened weight
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(1)]))
    opt = optstate.FusedAdamW([model.weight])
    try:
        optstate.save(sys.argv[1], model, opt)
    except NotImplementedError as e:
        assert "'weight'" in str(e) and "Shard(dim=1)" in str(e) and "torch.distributed.checkpoint" in str(e), e
        print("refused")
    # together: torch 2.13 + gloo aborts now and then (SIGABRT) when one rank destroys its group early
    dist.barrier()
    dist.destroy_process_group()
""")


def test_dtensor_layouts_other_than_fsdp2_rows_are_refused_with_a_way_out(tmp_path):
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    out = run_on_ranks(2, tmp_path / "ck", script=script)
    assert out.count("refused") == 2
    assert not (tmp_path / "ck").exists()
