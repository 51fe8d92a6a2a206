"""CPU AdamW step: optstate FusedAdamW vs torch.optim.AdamW (fused, foreach), side by side in one run.

Same ~100M-parameter Llama-shaped set for every optimizer, the copy bandwidth measured in the same
run, ms/step (median of timed steps after warm-up), speedup over torch fused, and % of copy
bandwidth at 28 bytes/param (fp32: read p, g, m, v; write p, m, v).

    .venv/bin/python bench/bench_adamw.py [--layers 8] [--steps 7] [--json bench/results/adamw_cpu.json]
"""
import argparse
import json
import os
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


def copy_bandwidth(numel, reps=7):
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 8 * numel / min(times)  # bytes read + written per second


def time_optimizer(name, make, shapes, steps, warmup=2):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt = make(params)
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    del opt, params
    return statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "adamw_cpu.json"))
    args = ap.parse_args()

    shapes = llama_shapes(args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    bw = copy_bandwidth(numel)
    candidates = [
        ("optstate FusedAdamW", lambda ps: optstate.FusedAdamW(ps, **kw)),
        ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True, **kw)),
        ("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **kw)),
    ]
    rows = []
    for name, make in candidates:
        med, best = time_optimizer(name, make, shapes, args.steps)
        rows.append({"name": name, "ms_median": med * 1e3, "ms_min": best * 1e3,
                     "pct_copy_bw": 100 * 28 * numel / med / bw})
    bw_after = copy_bandwidth(numel)
    ref = next(r for r in rows if r["name"] == "torch AdamW fused")["ms_median"]
    for r in rows:
        r["speedup_vs_torch_fused"] = ref / r["ms_median"]

    print(f"AdamW step on CPU: {numel / 1e6:.1f}M fp32 params in {len(shapes)} tensors, "
          f"{torch.get_num_threads()} threads, kernel ISA {optstate.ops.cpu_isa()}, torch {torch.__version__}")
    print(f"copy bandwidth {bw / 1e9:.2f} GB/s (after the runs: {bw_after / 1e9:.2f} GB/s); "
          f"floor at 28 B/param: {28 * numel / bw * 1e3:.1f} ms")
    print(f"{'optimizer':<22} {'ms/step':>9} {'best':>9} {'vs torch fused':>15} {'% copy BW':>10}")
    for r in rows:
        print(f"{r['name']:<22} {r['ms_median']:9.1f} {r['ms_min']:9.1f} {r['speedup_vs_torch_fused']:14.2f}x "
              f"{r['pct_copy_bw']:9.0f}%")
    out = {"params": numel, "tensors": len(shapes), "threads": torch.get_num_threads(),
           "copy_bw_GBps": bw / 1e9, "copy_bw_after_GBps": bw_after / 1e9, "bytes_per_param": 28,
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
