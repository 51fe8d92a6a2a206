"""CUDA optimizer step on the Llama-3.2-1B-shaped set of issue 6 (1,235,814,400 fp32 params in 146
tensors): optstate FusedAdamW and AdamW8bit (with a work-item size sweep) next to
torch.optim.AdamW(fused=True), torch.optim.AdamW(foreach=True) and torchao's AdamW8bit, with the copy
bandwidth measured in the same run; ms/step (median of --iters, CUDA events) and % of copy bandwidth
at 28 B/param (AdamW) and 16 B/param (8-bit). The same table scripts/gpu_check.sh prints after its
correctness checks; this runs the table alone (needs a GPU and the ops library built with CUDA:
OPTSTATE_OPS_LIBRARY=build-gpu/liboptstate_ops.so).

    python bench/bench_cuda.py [--iters 20] [--skip-torchao]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import check_cuda  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-torchao", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda: no CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    check_cuda.timing(args.iters, args.skip_torchao)


if __name__ == "__main__":
    main()
