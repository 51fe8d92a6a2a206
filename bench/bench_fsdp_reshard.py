"""Writing FSDP2's per-rank torch.save files (verl's actor/: model_world_size_N_rank_R.pt,
optim_world_size_N_rank_R.pt, extra_state_world_size_N_rank_R.pt) again for another world size M, which
verl needs to resume on another number of GPUs: `optstate reshard SRC DST --world-size M --format
torchsave` next to the way torch offers, side by side in one run on the same files and disk, cold
page cache, each a fresh process (group); wall time and peak RSS, and the raw copy as the floor.

- The files: a Llama-shaped stack (--layers pairs of 2048x4096 / 4096x2048 Linears) under FSDP2 (or,
  with --fsdp 1, FSDP1 with flat parameters and a device mesh, the stack one unit: verl's default
  strategy) on --ranks CPU processes (gloo), one torch.optim.AdamW step, every rank saving its model,
  optimizer and extra state as verl does (FSDP1: under SHARDED_STATE_DICT).
- torch: per-rank files load only into the world size that saved them, so: torchrun --ranks
  processes build and wrap the model, load their files as verl does (model.load_state_dict,
  optimizer.load_state_dict) and dcp.save the state; then torchrun --to processes build and wrap
  the model on the new world size, dcp.load and set_state_dict it, and save their files (the extra
  state copied from rank r mod --ranks, as optstate does). Its peak RSS is the largest of its
  processes.
- optstate: the CLI, one process, no model code.
Both outputs are read back with torch.load and must hold, rank by rank, the same local tensors of
every DTensor (weights and moments) and the same steps, bit for bit.

    .venv/bin/python bench/bench_fsdp_reshard.py [--fsdp 2] [--layers 2] [--ranks 4] [--to 2] [--reps 2] [--dir /tmp] [--json bench/results/fsdp_reshard.json]
"""
import os
import sys
import textwrap
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_ckpt import checkpoint_args, raw_read, raw_write  # noqa: E402
from bench_dcp_convert import prepare, report, run, same, time_cases  # noqa: E402

warnings.filterwarnings("ignore")

MODEL = textwrap.dedent("""
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import contextlib
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig
    sys.path.insert(0, BENCH)
    from bench_ckpt import make_model
    FSDP_VERSION = int(os.environ["BENCH_FSDP"])

    def build(layers):
        model = make_model(layers)
        if FSDP_VERSION == 1:
            # One FSDP unit of all the Linears: units of one param each look like use_orig_params in the files.
            model = FSDP(model, use_orig_params=False, device_mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                         device_id=torch.device("cpu"))
        else:
            for m in model:
                fully_shard(m)
            fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def sharded(model):  # what verl's get_fsdp_state_ctx gives: FSDP1's sharded state dicts
        if FSDP_VERSION == 1:
            return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                                        ShardedOptimStateDictConfig())
        return contextlib.nullcontext()
""")

MAKE = MODEL + textwrap.dedent("""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out, layers = sys.argv[1], int(sys.argv[2])
    model, opt = build(layers)
    for p in model.parameters():
        if FSDP_VERSION == 1:
            p.grad = torch.randn_like(p) * 1e-3
        else:
            p.grad = torch.distributed.tensor.DTensor.from_local(torch.randn_like(p.to_local()) * 1e-3, p.device_mesh,
                                                                 p.placements, shape=p.shape, stride=p.stride())
    opt.step()
    os.makedirs(out, exist_ok=True)
    with sharded(model):
        torch.save(model.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
        torch.save(opt.state_dict(), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
    torch.save({"lr_scheduler": None, "rng": torch.get_rng_state()}, f"{out}/extra_state_world_size_{world}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
""")

RESHARD_WITH_TORCH = MODEL + textwrap.dedent("""
    import shutil, subprocess
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    stage = sys.argv[1]
    if stage == "drive":  # SRC DST N M LAYERS: the two torchruns, through a DCP
        src, dst, n, m, layers = sys.argv[2:7]
        tmp = dst + ".dcp"
        run = lambda k, *a: subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                            f"--nproc-per-node={k}", __file__, *a], check=True)
        run(n, "to_dcp", src, tmp, layers)
        run(m, "from_dcp", tmp, dst, layers, src, n)
        shutil.rmtree(tmp)
        sys.exit(0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(int(sys.argv[4]))
    if stage == "to_dcp":  # verl's load on the saved world size, then a DCP of the state
        src, tmp = sys.argv[2], sys.argv[3]
        with sharded(model):
            model.load_state_dict(torch.load(f"{src}/model_world_size_{world}_rank_{rank}.pt", weights_only=False))
            opt.load_state_dict(torch.load(f"{src}/optim_world_size_{world}_rank_{rank}.pt", weights_only=False))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    else:  # the DCP loaded on the new world size, saved per rank as verl saves
        tmp, dst, src, n = sys.argv[2], sys.argv[3], sys.argv[5], int(sys.argv[6])
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=tmp)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        os.makedirs(dst, exist_ok=True)
        with sharded(model):
            torch.save(model.state_dict(), f"{dst}/model_world_size_{world}_rank_{rank}.pt")
            torch.save(opt.state_dict(), f"{dst}/optim_world_size_{world}_rank_{rank}.pt")
        shutil.copyfile(f"{src}/extra_state_world_size_{n}_rank_{rank % n}.pt",
                        f"{dst}/extra_state_world_size_{world}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
""")


def local(t):
    return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t


def main():
    ap = checkpoint_args(layers=2, reps=2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--to", type=int, default=2)
    ap.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    args = ap.parse_args()
    cli, work, env, scripts = prepare("fsdpreshard", args.dir, MAKE, RESHARD_WITH_TORCH, needs="torch")
    env["BENCH_FSDP"] = os.environ["BENCH_FSDP"] = str(args.fsdp)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
    src = work / "actor"
    t_make = run(torchrun + [scripts["make.py"], src, args.layers])
    files = sorted(src.iterdir())
    src_bytes = sum(f.stat().st_size for f in files)
    print(f"source: {src_bytes / 1e9:.2f} GB in {len(files)} per-rank files of FSDP{args.fsdp} + torch AdamW ({args.layers} "
          f"layer pairs, {args.ranks} ranks, made in {t_make:.0f} s), written for {args.to} ranks; "
          f"{os.cpu_count()} cpus, torch {torch.__version__}")

    reference = f"torch (FSDP{args.fsdp} + DCP, torchrun)"
    dst = {"optstate": work / "actor_optstate", reference: work / "actor_torch"}
    cases = {
        "optstate": lambda out: [cli, "reshard", src, out, "--world-size", args.to, "--format", "torchsave"],
        reference: lambda out: [sys.executable, scripts["convert_reference.py"], "drive", src, out, args.ranks, args.to,
                                args.layers],
    }
    times, peak = time_cases(cases, dst, src, args.reps, env)
    out_files = sorted(dst["optstate"].iterdir())
    dst_bytes = sum(f.stat().st_size for f in out_files)
    buf = bytearray(max(f.stat().st_size for f in files + out_files))
    for rep in range(args.reps):
        t = sum(raw_read(f, memoryview(buf)[:f.stat().st_size]) for f in files)
        times["floor (raw copy)"].append(t + sum(raw_write(work / "raw_copy", memoryview(buf)[:f.stat().st_size])
                                                 for f in out_files))

    assert sorted(f.name for f in out_files) == sorted(f.name for f in dst[reference].iterdir())
    bad, tensors = [], 0
    for r in range(args.to):
        for kind in ("model", "optim", "extra_state"):
            name = f"{kind}_world_size_{args.to}_rank_{r}.pt"
            a = torch.load(dst["optstate"] / name, weights_only=False)
            b = torch.load(dst[reference] / name, weights_only=False)
            if kind == "model":
                pairs = [(k, a[k], b[k]) for k in b]
            elif kind == "optim":
                pairs = [(f"{i}.{k}", a["state"][i][k], b["state"][i][k]) for i in b["state"] for k in b["state"][i]]
            else:
                pairs = [("rng", a["rng"], b["rng"])]
            for key, x, y in pairs:
                tensors += 1
                if not same(local(x), local(y)):
                    bad.append((name, key))
    assert not bad, f"outputs differ: {bad[:8]}"
    print(f"outputs: {dst_bytes / 1e9:.2f} GB in {len(out_files)} files each; {tensors} tensors (DTensors' local "
          f"parts, steps, RNG states) equal bit for bit, rank by rank")
    report(args, work, times, peak, src_bytes, dst_bytes, reference=reference)


if __name__ == "__main__":
    main()
