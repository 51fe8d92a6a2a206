"""Params stored other than contiguously: a channels_last conv net's weights, stepped by optstate
FusedAdamW / AdamW8bit and torch.optim.AdamW (fused), each against the same weights contiguous,
side by side in one run (round-robin, best of --steps; the ratio is channels_last / contiguous).

FusedAdamW keeps such a param's moments in its layout and steps it in place (the ratio should be
~1); AdamW8bit steps it through a contiguous working copy (its 8-bit blocks follow logical order):
two permuting copies of the param and one of its gradient per step.

    .venv/bin/python bench/bench_channels_last.py [--threads 1] [--steps 15]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import optstate  # noqa: E402

# A ResNet-style stage of 3x3 convs: 4 x 512x512x3x3 = 9.4M params.
SHAPES = [(512, 512, 3, 3)] * 4


def params(channels_last):
    g = torch.Generator().manual_seed(0)
    out = []
    for s in SHAPES:
        p = torch.randn(s, generator=g)
        if channels_last:
            p = p.contiguous(memory_format=torch.channels_last)
        p = torch.nn.Parameter(p)
        p.grad = torch.randn(s, generator=g).to(memory_format=torch.channels_last if channels_last
                                                else torch.contiguous_format)
        out.append(p)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    makers = {
        "optstate FusedAdamW": lambda ps: optstate.FusedAdamW(ps, lr=1e-3),
        "optstate AdamW8bit": lambda ps: optstate.AdamW8bit(ps, lr=1e-3),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    }
    opts = {(name, cl): make(params(cl)) for name, make in makers.items() for cl in (False, True)}
    best = {k: float("inf") for k in opts}
    for _ in range(args.steps):
        for k, opt in opts.items():
            t = time.perf_counter()
            opt.step()
            best[k] = min(best[k], time.perf_counter() - t)
    n = sum(torch.Size(s).numel() for s in SHAPES)
    print(f"{n / 1e6:.1f}M params in {len(SHAPES)} conv weights, {args.threads} thread(s), best of {args.steps}")
    print(f"{'optimizer':<22}{'contiguous ms':>15}{'channels_last ms':>18}{'ratio':>8}")
    for name in makers:
        a, b = best[(name, False)] * 1e3, best[(name, True)] * 1e3
        print(f"{name:<22}{a:>15.2f}{b:>18.2f}{b / a:>8.2f}")


if __name__ == "__main__":
    main()
