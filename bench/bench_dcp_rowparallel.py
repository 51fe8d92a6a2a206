"""Converting a tensor-parallel DCP whose row-parallel weights are column-sharded (RowwiseParallel's
Shard(1), as torchtitan shards attention.wo and feed_forward.w2) into one torch.save file:
`optstate convert SRC optimizer.pt` next to torch's own `dcp_to_torch_save`, side by side in one run on
the same checkpoint and disk, cold page cache, each a fresh process; wall time and peak RSS of each.

Every rank's chunk of such a weight (and of its exp_avg, exp_avg_sq) is [rows, cols / tp]: in the
flattened tensor, one short run per row per rank. A 70B Llama at TP 8 has about 10 million of them
per state tensor kind (80 layers x 2 weights x 8192 rows x 8 ranks), with runs of 1024 floats. The
checkpoint here: --layers Linear(--cols, --rows) weights, RowwiseParallel over --tp gloo ranks,
one torch.optim.AdamW step, saved as torchtitan saves (weights at the top level, the optimizer
flattened under "optimizer"). Its run count per kind is printed beside the table.
- torch: dcp_to_torch_save(SRC, DST), which loads the whole state into memory.
- optstate: the CLI, no Python.
- floor: read SRC's bytes cold, write DST's byte count and fsync.
Both outputs are loaded with torch.load and their weights and moments compared, bit for bit.

    .venv/bin/python bench/bench_dcp_rowparallel.py [--layers 4] [--rows 65536] [--cols 512] [--tp 8] [--reps 2]
        [--dir /tmp] [--json bench/results/dcp_rowparallel.json]
"""
import os
import sys
import textwrap
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_ckpt import checkpoint_args, dir_bytes  # noqa: E402
from bench_dcp_convert import prepare, run  # noqa: E402
from bench_dcp_wide import CONVERT_WITH_TORCH, against_torch, optstate_matches  # noqa: E402

warnings.filterwarnings("ignore")

MAKE = textwrap.dedent("""
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    dist.init_process_group("gloo")
    out, layers, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(cols, rows, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {str(i): RowwiseParallel() for i in range(layers)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for p in model.parameters():
        local = p.to_local()
        p.grad = DTensor.from_local(torch.randn(local.shape, generator=g) * 1e-3, p.device_mesh, p.placements,
                                    shape=p.shape, stride=p.stride())
    opt.step()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save(dict(msd, optimizer=osd), checkpoint_id=out)
    dist.destroy_process_group()
""")

def run_count(layers, rows, tp):
    return layers * rows * tp


def same_state(torch_out, optstate_out):
    """torch's file holds the DCP's state dict as it was saved (weights by fqn, the flattened
    optimizer's items as "state.<fqn>.<entry>"); optstate's must hold the same weights and state."""
    a = torch.load(torch_out, weights_only=False)
    flat = {k: v for k, v in a.items() if k != "optimizer"}
    flat.update({"optimizer." + k: torch.as_tensor(v) for k, v in a["optimizer"].items() if k.startswith("state.")})
    return optstate_matches(optstate_out, flat, ("exp_avg", "exp_avg_sq", "step"))


def main():
    ap = checkpoint_args(layers=4, reps=2)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--tp", type=int, default=8)
    args = ap.parse_args()
    if args.cols % args.tp:
        sys.exit("--cols must be a multiple of --tp")
    cli, work, env, scripts = prepare("dcp-rowparallel", args.dir, MAKE, CONVERT_WITH_TORCH, needs="torch")
    src = work / "src"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tp}",
         scripts["make.py"], src, args.layers, args.rows, args.cols])
    src_bytes = dir_bytes(src)
    runs = run_count(args.layers, args.rows, args.tp)
    print(f"SRC: {src_bytes / 1e9:.2f} GB, {args.layers} x [{args.rows}, {args.cols}] weights column-sharded over "
          f"{args.tp} ranks: {runs:,} runs of {args.cols // args.tp} floats per state tensor kind "
          f"({3 * runs:,} in weights, exp_avg and exp_avg_sq); {os.cpu_count()} cpus, torch {torch.__version__}")
    against_torch(args, cli, work, env, scripts, src, src_bytes,
                  lambda dst: same_state(dst["torch"], dst["optstate"]),
                  "outputs equal: weights, exp_avg, exp_avg_sq and step of every param, bit for bit")

if __name__ == "__main__":
    main()
