"""Checkpoints of many small params (a mixture of experts keeps tens of thousands of tensors: one per
expert per weight per layer): the cost that grows with the number of tensors, not their bytes.
optstate next to PyTorch on the same state, side by side in one run, at two sizes (--params, and a
tenth of it), so that a cost that grows faster than the tensors shows as a ratio above 10.

The state: --params params of 4x4 and 4 elements (Linear layers) with one AdamW step, so that
metadata, not data, is what is read and written. Warm page cache (the bytes are a few MB).
- save: optstate.save (FusedAdamW, native format) vs dcp.save (get_state_dict of torch.optim.AdamW);
- load: optstate.load into FusedAdamW (transactional: checked, then read) vs dcp.load into the state
  dict of a live model and AdamW;
- read: optstate.read_state_dict of torch's own DCP and of a torch.save file ({"model", "optimizer"})
  vs dcp.load of that DCP and torch.load of that file;
- CLI: `optstate convert` of the native checkpoint to each format, and `optstate validate` of what
  it wrote, each a fresh process.
Median of --reps, round-robin.

    .venv/bin/python bench/bench_many_params.py [--params 30000] [--reps 3] [--dir /tmp] [--json bench/results/many_params.json]
"""
import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "python"))
sys.path.insert(0, str(BENCH))
import optstate  # noqa: E402
from bench_ckpt import dir_bytes, write_json  # noqa: E402

warnings.filterwarnings("ignore")
CLI = BENCH.parent / "build" / "optstate"
FORMATS = (("native", "native"), ("dcp", "dcp"), ("hdf5", "x.h5"), ("safetensors", "x.safetensors"),
           ("torchsave", "x.pt"))


def model_and_optimizers(params):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(params // 2)])
    ours, theirs = optstate.FusedAdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    ours.step()
    theirs.step()
    return model, ours, theirs


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cli(*args):
    t = time.perf_counter()
    proc = subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"optstate {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t


def measure(params, reps, work):
    model, ours, theirs = model_and_optimizers(params)
    native, tdcp, tsave = work / "native", work / "torch_dcp", work / "torch.pt"

    def torch_state():
        msd, osd = get_state_dict(model, theirs)
        return {"model": msd, "optim": osd}

    def dcp_save():
        shutil.rmtree(tdcp, ignore_errors=True)
        dcp.save(torch_state(), checkpoint_id=str(tdcp))

    def dcp_load():
        dcp.load(torch_state(), checkpoint_id=str(tdcp))

    torch.save({"model": model.state_dict(), "optimizer": theirs.state_dict()}, tsave)
    optstate.save(native, model, ours)
    dcp_save()
    cases = [
        ("save", "optstate.save", lambda: timed(lambda: optstate.save(native, model, ours))),
        ("save", "dcp.save", lambda: timed(dcp_save)),
        ("load", "optstate.load", lambda: timed(lambda: optstate.load(native, model, ours))),
        ("load", "dcp.load", lambda: timed(dcp_load)),
        ("read torch's DCP", "optstate.read_state_dict", lambda: timed(lambda: optstate.read_state_dict(tdcp))),
        ("read torch's DCP", "dcp.load", lambda: timed(dcp_load)),
        ("read a torch.save file", "optstate.read_state_dict", lambda: timed(lambda: optstate.read_state_dict(tsave))),
        ("read a torch.save file", "torch.load", lambda: timed(lambda: torch.load(tsave, weights_only=True))),
    ]
    for fmt, name in FORMATS:
        out = work / f"out_{name}"
        cases.append((f"CLI {fmt}", "optstate convert", lambda fmt=fmt, out=out: cli(
            "convert", native, out, "--format", fmt, "--overwrite")))
        cases.append((f"CLI {fmt}", "optstate validate", lambda out=out: cli("validate", out)))
    times = {(what, who): [] for what, who, _ in cases}
    for _ in range(reps):
        for what, who, fn in cases:
            times[(what, who)].append(fn())

    def size(path):
        return dir_bytes(path) if path.is_dir() else path.stat().st_size

    sizes = {"optstate.save (native)": size(native), "dcp.save": size(tdcp), "torch.save": size(tsave)}
    sizes.update({f"optstate convert -> {fmt}": size(work / f"out_{name}") for fmt, name in FORMATS})
    return {k: statistics.median(v) for k, v in times.items()}, sizes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=30000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json")
    args = ap.parse_args()
    if not CLI.exists():
        sys.exit(f"{CLI} is missing: build first (scripts/setup.sh)")
    sizes = (max(2, args.params // 10 // 2 * 2), args.params // 2 * 2)
    results, on_disk = {}, {}
    for n in sizes:
        work = Path(tempfile.mkdtemp(prefix="optstate-many-", dir=args.dir))
        try:
            results[n], on_disk[n] = measure(n, args.reps, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    small, large = sizes
    print(f"many small params ({small:,} and {large:,} params of 4x4 or 4 elements, AdamW state; median of "
          f"{args.reps}; warm cache; torch {torch.__version__})")
    print(f"{'':24} {'':26} {small:>9,} {large:>9,}  growth  vs torch ({large:,})")
    for (what, who), t in results[large].items():
        ref = {"save": "dcp.save", "load": "dcp.load", "read torch's DCP": "dcp.load",
               "read a torch.save file": "torch.load"}.get(what)
        vs = ""
        if ref and who != ref:
            vs = f"{results[large][(what, ref)] / t:5.1f}x faster"
        print(f"{what:24} {who:26} {results[small][(what, who)]:8.3f}s {t:8.3f}s {t / results[small][(what, who)]:6.1f}x"
              f"  {vs}")
    print(f"\nbytes on disk ({large:,} params; the state itself is {large // 2 * 20 * 3 * 4:,} bytes of fp32: "
          f"weights and two moments)")
    for who, b in on_disk[large].items():
        print(f"{who:34} {b:>14,} B  {b / (large):8.0f} B/param")
    write_json(args.json, {"params": list(sizes), "torch": torch.__version__, "reps": args.reps,
                           "seconds": {str(n): {f"{w} | {who}": t for (w, who), t in r.items()} for n, r in
                                       results.items()},
                           "bytes": {str(n): b for n, b in on_disk.items()}})


if __name__ == "__main__":
    main()
