"""CPU 8-bit AdamW step: optstate AdamW8bit vs optstate FusedAdamW vs torch.optim.AdamW(fused=True) vs
torchao AdamW8bit (its torch.compile'd CPU step), side by side in one run on the same ~100M-param
Llama-shaped set. Prints ms/step (median), ratios, % of the bandwidth measured in the same run at the
bytes each optimizer must move per fp32 param (16 B for 8-bit: p r/w 8, g 4, two 1-byte codes r/w 4;
28 B for fp32 state), and state bytes per param measured from the optimizers' state tensors.

    .venv/bin/python bench/bench_adamw8bit.py [--layers 8] [--steps 5] [--no-torchao]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import optstate  # noqa: E402
from bench_adamw import bandwidths, llama_shapes, make_params  # noqa: E402


def state_bytes(opt):
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if k == "step" or not isinstance(v, torch.Tensor):
                continue
            if hasattr(v, "codes"):  # torchao OptimState8bit
                total += v.codes.nbytes + v.scale.nbytes
            else:
                total += v.nbytes
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "adamw8bit_cpu.json"))
    args = ap.parse_args()
    shapes = llama_shapes(args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    cands = [("optstate AdamW8bit", 16, lambda ps: optstate.AdamW8bit(ps, **kw)),
             ("optstate FusedAdamW", 28, lambda ps: optstate.FusedAdamW(ps, **kw)),
             ("torch AdamW fused", 28, lambda ps: torch.optim.AdamW(ps, fused=True, **kw))]
    if not args.no_torchao:
        try:
            from torchao.optim import AdamW8bit as TaoAdamW8bit
            cands.append(("torchao AdamW8bit", 16, lambda ps: TaoAdamW8bit(ps, **kw)))
        except ImportError as e:
            print(f"torchao not importable: {e}")
    copy_bw, rmw_bw = bandwidths(numel)
    opts, first = [], []
    for name, _, make in cands:
        opt = make(make_params(shapes))
        t0 = time.perf_counter()
        opt.step()  # torchao compiles here
        first.append(time.perf_counter() - t0)
        opt.step()
        opts.append(opt)
    times = [[] for _ in opts]
    for _ in range(args.steps):
        for i, opt in enumerate(opts):
            t0 = time.perf_counter()
            opt.step()
            times[i].append(time.perf_counter() - t0)
    rows = []
    for (name, bpp, _), opt, t, f in zip(cands, opts, times, first):
        med = statistics.median(t)
        rows.append({"name": name, "ms_median": med * 1e3, "first_step_s": f, "bytes_moved_per_param": bpp,
                     "pct_copy_bw": 100 * bpp * numel / med / copy_bw, "pct_rmw_bw": 100 * bpp * numel / med / rmw_bw,
                     "state_bytes_per_param": state_bytes(opt) / numel})
    ref = {r["name"]: r["ms_median"] for r in rows}
    print(f"8-bit AdamW on CPU: {numel / 1e6:.1f}M fp32 params, {len(shapes)} tensors, {torch.get_num_threads()} "
          f"threads; copy {copy_bw / 1e9:.2f} GB/s, in-place rmw {rmw_bw / 1e9:.2f} GB/s; optstate kernels: "
          f"fp32 {optstate.ops.cpu_isa()}, 8-bit {optstate.ops.cpu_isa_8bit()} (OPTSTATE_CPU_ISA=avx512, avx512-gather, avx2 or generic "
          f"picks another)")
    print(f"{'optimizer':<22} {'ms/step':>9} {'vs ours fp32':>13} {'ours 8bit is':>13} {'% copy BW':>10} "
          f"{'% rmw BW':>9} {'state B/param':>14} {'first step s':>13}")
    for r in rows:
        r["ratio_to_ours_fp32"] = r["ms_median"] / ref["optstate FusedAdamW"]
        r["ours_8bit_speedup"] = r["ms_median"] / ref["optstate AdamW8bit"]
        print(f"{r['name']:<22} {r['ms_median']:9.1f} {r['ratio_to_ours_fp32']:12.2f}x {r['ours_8bit_speedup']:12.2f}x "
              f"{r['pct_copy_bw']:9.0f}% {r['pct_rmw_bw']:8.0f}% {r['state_bytes_per_param']:14.3f} "
              f"{r['first_step_s']:13.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"params": numel, "isa_8bit": optstate.ops.cpu_isa_8bit(), "copy_bw_GBps": copy_bw / 1e9,
                                           "rmw_bw_GBps": rmw_bw / 1e9, "rows": rows}, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
