"""CPU AdamW step: optstate FusedAdamW vs torch.optim.AdamW (fused, foreach), side by side in one run.

Same ~100M-parameter Llama-shaped set for every optimizer, timed round-robin (one step of each in
turn, so drift in the machine's bandwidth hits all alike), ms/step (median), speedup over torch
fused, and % of bandwidth at 28 bytes/param (fp32: read p, g, m, v; write p, m, v), against two
bandwidths measured in the same run:
- copy: dst.copy_(src) counted as 8 B/element (the convention of the issue's goal). A copy also
  reads each destination line before writing it, so it moves 12 B/element and this number
  understates the memory system; an optimizer step can exceed 100% of it.
- rmw: a.add_(b) counted as 12 B/element: reads two streams, writes one back in place, as an
  optimizer does (its written lines were just read, so no extra traffic). This is the roofline.

    .venv/bin/python bench/bench_adamw.py [--layers 8] [--steps 7] [--json bench/results/adamw_cpu.json]
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import optstate  # noqa: E402


def llama_shapes(layers, hidden=1024, kv=256, ffn=2816, vocab=8192):
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    shapes.append((hidden,))
    return shapes


def bandwidths(numel, reps=7):
    a, b = torch.randn(numel), torch.randn(numel)
    c = torch.empty_like(a)

    def best(f):
        f()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times)

    copy = 8 * numel / best(lambda: c.copy_(a))
    rmw = 12 * numel / best(lambda: a.add_(b))
    return copy, rmw


def make_params(shapes):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return params


def time_round_robin(candidates, shapes, steps, warmup=2):
    opts = [make(make_params(shapes)) for _, make in candidates]
    for _ in range(warmup):
        for opt in opts:
            opt.step()
    times = [[] for _ in opts]
    for _ in range(steps):
        for i, opt in enumerate(opts):
            t0 = time.perf_counter()
            opt.step()
            times[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), min(t)) for t in times]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "adamw_cpu.json"))
    args = ap.parse_args()

    shapes = llama_shapes(args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    bw, rmw = bandwidths(numel)
    candidates = [
        ("optstate FusedAdamW", lambda ps: optstate.FusedAdamW(ps, **kw)),
        ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True, **kw)),
        ("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **kw)),
    ]
    rows = []
    for (name, _), (med, best) in zip(candidates, time_round_robin(candidates, shapes, args.steps)):
        rows.append({"name": name, "ms_median": med * 1e3, "ms_min": best * 1e3,
                     "pct_copy_bw": 100 * 28 * numel / med / bw, "pct_rmw_bw": 100 * 28 * numel / med / rmw})
    bw_after, rmw_after = bandwidths(numel)
    ref = next(r for r in rows if r["name"] == "torch AdamW fused")["ms_median"]
    for r in rows:
        r["speedup_vs_torch_fused"] = ref / r["ms_median"]

    print(f"AdamW step on CPU: {numel / 1e6:.1f}M fp32 params in {len(shapes)} tensors, "
          f"{torch.get_num_threads()} threads, kernel ISA {optstate.ops.cpu_isa()}, torch {torch.__version__}")
    print(f"copy bandwidth {bw / 1e9:.2f} GB/s, in-place rmw bandwidth {rmw / 1e9:.2f} GB/s "
          f"(after the runs: {bw_after / 1e9:.2f} / {rmw_after / 1e9:.2f}); "
          f"floor at 28 B/param: {28 * numel / rmw * 1e3:.1f} ms at rmw bandwidth")
    print(f"{'optimizer':<22} {'ms/step':>9} {'best':>9} {'vs torch fused':>15} {'% copy BW':>10} {'% rmw BW':>9}")
    for r in rows:
        print(f"{r['name']:<22} {r['ms_median']:9.1f} {r['ms_min']:9.1f} {r['speedup_vs_torch_fused']:14.2f}x "
              f"{r['pct_copy_bw']:9.0f}% {r['pct_rmw_bw']:8.0f}%")
    out = {"params": numel, "tensors": len(shapes), "threads": torch.get_num_threads(),
           "copy_bw_GBps": bw / 1e9, "copy_bw_after_GBps": bw_after / 1e9,
           "rmw_bw_GBps": rmw / 1e9, "rmw_bw_after_GBps": rmw_after / 1e9, "bytes_per_param": 28,
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
