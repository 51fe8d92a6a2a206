"""Consolidating FSDP2's per-rank torch.save files of torchao's AdamW8bit (verl's
optim_world_size_N_rank_R.pt + model_world_size_N_rank_R.pt, DTensors) into one plain
torch.optim.AdamW {"model", "optimizer"} file: `optstate convert DIR plain.pt` next to the Python
way (torch + torchao installed), side by side in one run on the same files and disk, cold page
cache, each a fresh process; wall time and peak RSS of each, and the raw copy as the floor.

- The files: a Llama-shaped stack (--layers pairs of 2048x4096 / 4096x2048 Linears) under FSDP2 on
  --ranks CPU processes (gloo), one torchao AdamW8bit step (block 256; its torch.compile replaced by
  eager: the step is only there to leave state), every rank saving its model and optimizer
  state_dicts as verl does.
- torch + torchao: torch.load every rank's files (torchao rebuilds OptimState8bit), each DTensor's
  local parts put together by rows in mesh order (FSDP2's Shard(0)), 8-bit parts dequantized,
  params named from the model's state_dict, torch.save.
- optstate: the CLI, no Python, no torchao.
Both outputs are read back with torch.load(weights_only=True) and must hold the same weights,
steps and moments, bit for bit.

    .venv/bin/python bench/bench_fsdp_ranks.py [--layers 2] [--ranks 4] [--reps 2] [--dir /tmp] [--json bench/results/fsdp_ranks.json]
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

MAKE = textwrap.dedent("""
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, BENCH)
    from bench_ckpt import make_model
    from torchao.optim import AdamW8bit
    torch.compile = lambda fn, **kwargs: fn
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out, layers = sys.argv[1], int(sys.argv[2])
    model = make_model(layers)
    for m in model:
        fully_shard(m)
    fully_shard(model)
    opt = AdamW8bit(model.parameters(), lr=1e-3, block_size=256)
    for p in model.parameters():
        p.grad = torch.distributed.tensor.DTensor.from_local(torch.randn_like(p.to_local()) * 1e-3, p.device_mesh,
                                                             p.placements, shape=p.shape, stride=p.stride())
    opt.step()
    os.makedirs(out, exist_ok=True)
    torch.save(model.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
    torch.save(opt.state_dict(), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
""")

CONVERT_WITH_TORCHAO = textwrap.dedent("""
    import glob, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torchao.optim  # noqa: F401  (torch.load rebuilds OptimState8bit through it)
    src, dst, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    models = [torch.load(f"{src}/model_world_size_{world}_rank_{r}.pt", weights_only=False, mmap=True) for r in range(world)]
    optims = [torch.load(f"{src}/optim_world_size_{world}_rank_{r}.pt", weights_only=False, mmap=True) for r in range(world)]

    def full(parts):  # FSDP2's Shard(0): the ranks' local parts by rows, in mesh order
        locals_ = sorted(((p.device_mesh.get_coordinate(), p.to_local()) for p in parts), key=lambda x: x[0])
        locals_ = [t.dequantize() if hasattr(t, "dequantize") else t for _, t in locals_]
        return torch.cat(locals_) if locals_[0].dim() else locals_[0]

    names = [n for n, v in models[0].items() if isinstance(v, torch.distributed.tensor.DTensor)]
    weights = {n: full([m[n] for m in models]) for n in names}
    state = {}
    for i in optims[0]["state"]:
        st = {}
        for k, v in optims[0]["state"][i].items():
            st[k] = full([o["state"][i][k] for o in optims]) if isinstance(v, torch.distributed.tensor.DTensor) else v
        state[i] = st
    groups = []
    for g in optims[0]["param_groups"]:
        g = dict(g, lr=float(g["lr"]), param_names=[names[i] for i in g["params"]])
        groups.append(g)
    torch.save({"model": weights, "optimizer": {"state": state, "param_groups": groups}}, dst)
""")


def main():
    ap = checkpoint_args(layers=2, reps=2)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    cli, work, env, scripts = prepare("fsdpranks", args.dir, MAKE, CONVERT_WITH_TORCHAO)
    src = work / "actor"
    t_make = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
                  scripts["make.py"], src, args.layers])
    files = sorted(src.iterdir())
    src_bytes = sum(f.stat().st_size for f in files)
    print(f"source: {src_bytes / 1e9:.2f} GB in {len(files)} per-rank files of FSDP2 + torchao AdamW8bit "
          f"({args.layers} layer pairs, {args.ranks} ranks, made in {t_make:.0f} s); {os.cpu_count()} cpus, "
          f"torch {torch.__version__}")

    dst = {"optstate": work / "plain_optstate.pt", "torch + torchao": work / "plain_torchao.pt"}
    cases = {
        "optstate": lambda out: [cli, "convert", src, out],
        "torch + torchao": lambda out: [sys.executable, scripts["convert_reference.py"], src, out, args.ranks],
    }
    times, peak = time_cases(cases, dst, src, args.reps, env)
    dst_bytes = os.path.getsize(dst["optstate"])
    buf = bytearray(max(max(f.stat().st_size for f in files), dst_bytes))
    for rep in range(args.reps):
        t = sum(raw_read(f, memoryview(buf)[:f.stat().st_size]) for f in files)
        times["floor (raw copy)"].append(t + raw_write(work / "raw_copy", memoryview(buf)[:dst_bytes]))

    a = torch.load(dst["optstate"], weights_only=True)
    b = torch.load(dst["torch + torchao"], weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    bad = [n for n in b["model"] if not same(b["model"][n], a["model"][n])]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    bad += [(i, k) for i in sb for k in sb[i] if not same(sb[i][k], sa[i].get(k))]
    assert not bad, f"outputs differ: {bad[:8]}"
    names_a = [n for g in a["optimizer"]["param_groups"] for n in g["param_names"]]
    names_b = [n for g in b["optimizer"]["param_groups"] for n in g["param_names"]]
    assert names_a == names_b, (names_a, names_b)
    print(f"outputs: {dst_bytes / 1e9:.2f} GB each; {len(b['model'])} weights and "
          f"{sum(len(s) for s in sb.values())} state tensors equal bit for bit, names equal")
    report(args, work, times, peak, src_bytes, dst_bytes)


if __name__ == "__main__":
    main()
