"""Consolidating FSDP1's per-rank torch.save files (verl's FSDP strategy: optim_world_size_N_rank_R.pt
holding plain parts of FSDP's flat parameters, model_world_size_N_rank_R.pt of DTensors) into one
plain torch.optim.AdamW {"model", "optimizer"} file: `optstate convert DIR plain.pt` next to the
way torch offers, side by side in one run on the same files and disk, cold page cache, each a fresh
process (group); wall time and peak RSS, and the raw copy as the floor.

- The files: a Llama-shaped model (embedding, --layers decoder blocks of q/k/v/o, gate/up/down and
  two norms, a final norm and the head) under FullyShardedDataParallel (use_orig_params=False, verl's
  default; each block a unit, the rest in the root's) on --ranks CPU processes (gloo), one
  torch.optim.AdamW step, every rank saving under SHARDED_STATE_DICT as verl does.
- torch: the flat parameters name nothing, so the files are only readable through FSDP itself:
  torchrun --ranks processes build and wrap the model, load every rank's files
  (model.load_state_dict, optimizer.load_state_dict under SHARDED_STATE_DICT), gather
  FSDP.optim_state_dict and model.state_dict under FULL_STATE_DICT, and rank 0 saves them. Its peak
  RSS is the largest of its processes (the sum is about --ranks times that).
- optstate: the CLI, one process, no model code.
Both outputs are read back with torch.load and must hold the same weights, steps and moments by
name, bit for bit.

    .venv/bin/python bench/bench_fsdp1_ranks.py [--layers 4] [--ranks 4] [--reps 2] [--dir /tmp] [--json bench/results/fsdp1_ranks.json]
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
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, ShardedOptimStateDictConfig,
                                        ShardedStateDictConfig)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    HIDDEN, KV, FFN, VOCAB = 1024, 256, 2816, 8192

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, KV, bias=False), nn.Linear(HIDDEN, KV, bias=False)
            self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.gate, self.up = nn.Linear(HIDDEN, FFN, bias=False), nn.Linear(HIDDEN, FFN, bias=False)
            self.down = nn.Linear(FFN, HIDDEN, bias=False)
            self.norm1, self.norm2 = nn.LayerNorm(HIDDEN, bias=False), nn.LayerNorm(HIDDEN, bias=False)

    class Model(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList([Block() for _ in range(layers)])
            self.norm, self.head = nn.LayerNorm(HIDDEN, bias=False), nn.Linear(HIDDEN, VOCAB, bias=False)

    def wrapped(layers):
        torch.manual_seed(0)
        dist.init_process_group("gloo")
        model = FSDP(Model(layers), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=False,
                     device_mesh=init_device_mesh("cpu", (dist.get_world_size(),)), device_id=torch.device("cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def sharded(model):
        return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                                    ShardedOptimStateDictConfig())
""")

MAKE = MODEL + textwrap.dedent("""
    out, layers = sys.argv[1], int(sys.argv[2])
    model, opt = wrapped(layers)
    rank, world = dist.get_rank(), dist.get_world_size()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    os.makedirs(out, exist_ok=True)
    with sharded(model):
        torch.save(model.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
        torch.save(opt.state_dict(), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
""")

CONVERT_WITH_TORCH = MODEL + textwrap.dedent("""
    src, dst, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, opt = wrapped(layers)
    rank, world = dist.get_rank(), dist.get_world_size()
    with sharded(model):
        model.load_state_dict(torch.load(f"{src}/model_world_size_{world}_rank_{rank}.pt", weights_only=False))
        opt.load_state_dict(torch.load(f"{src}/optim_world_size_{world}_rank_{rank}.pt", weights_only=False))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                              FullOptimStateDictConfig(rank0_only=True)):
        weights = model.state_dict()
        state = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"model": weights, "optimizer": state}, dst)
    dist.barrier()
    dist.destroy_process_group()
""")


def main():
    ap = checkpoint_args(layers=4, reps=2)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    cli, work, env, scripts = prepare("fsdp1ranks", args.dir, MAKE, CONVERT_WITH_TORCH)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
    src = work / "actor"
    t_make = run(torchrun + [scripts["make.py"], src, args.layers])
    files = sorted(src.iterdir())
    src_bytes = sum(f.stat().st_size for f in files)
    print(f"source: {src_bytes / 1e9:.2f} GB in {len(files)} per-rank files of FSDP1 (flat parameters) + "
          f"torch AdamW ({args.layers} blocks, {args.ranks} ranks, made in {t_make:.0f} s); {os.cpu_count()} cpus, "
          f"torch {torch.__version__}")

    dst = {"optstate": work / "plain_optstate.pt", "torch (FSDP, torchrun)": work / "plain_torch.pt"}
    cases = {
        "optstate": lambda out: [cli, "convert", src, out],
        "torch (FSDP, torchrun)": lambda out: torchrun + [scripts["convert_reference.py"], src, out, args.layers],
    }
    times, peak = time_cases(cases, dst, src, args.reps, env)
    dst_bytes = os.path.getsize(dst["optstate"])
    buf = bytearray(max(max(f.stat().st_size for f in files), dst_bytes))
    for rep in range(args.reps):
        t = sum(raw_read(f, memoryview(buf)[:f.stat().st_size]) for f in files)
        times["floor (raw copy)"].append(t + raw_write(work / "raw_copy", memoryview(buf)[:dst_bytes]))

    a = torch.load(dst["optstate"], weights_only=True)
    b = torch.load(dst["torch (FSDP, torchrun)"], weights_only=False)
    assert a["model"].keys() == b["model"].keys()
    bad = [n for n in b["model"] if not same(b["model"][n], a["model"][n])]
    names = [n for g in a["optimizer"]["param_groups"] for n in g["param_names"]]
    ids = [i for g in a["optimizer"]["param_groups"] for i in g["params"]]
    ours = {n: a["optimizer"]["state"][i] for n, i in zip(names, ids)}
    theirs = b["optimizer"]["state"]
    assert ours.keys() == theirs.keys(), (sorted(ours)[:4], sorted(theirs)[:4])
    bad += [(n, k) for n in theirs for k in theirs[n] if not same(theirs[n][k], ours[n].get(k))]
    assert not bad, f"outputs differ: {bad[:8]}"
    print(f"outputs: {dst_bytes / 1e9:.2f} GB; {len(b['model'])} weights and "
          f"{sum(len(s) for s in theirs.values())} state tensors equal bit for bit, by name")
    report(args, work, times, peak, src_bytes, dst_bytes, reference="torch (FSDP, torchrun)")


if __name__ == "__main__":
    main()
