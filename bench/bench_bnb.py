"""Turning Hugging Face Trainer's `optimizer.pt` of bitsandbytes' AdamW8bit (optim="adamw_bnb_8bit":
uint8 `state1`/`state2` codes, per-block `absmax`, the `qmap`s, nested in
`__bnb_optimizer_quant_state__`) into one that plain torch.optim.AdamW loads:
`optstate convert optimizer.pt plain.pt` next to the way it is done with torch and bitsandbytes
installed, side by side in one run on the same file and disk, cold page cache, each a fresh
process; wall time and peak RSS of each, and the raw copy as the floor.

- The file: a Llama-shaped stack (--layers pairs of 2048x4096 / 4096x2048 Linears), one
  bitsandbytes AdamW8bit step on the CPU (blocks of 256), `torch.save(opt.state_dict(), ...)` as the
  Trainer saves it (params unnamed).
- torch + bitsandbytes: torch.load, `bitsandbytes.functional.dequantize_blockwise` of each 8-bit
  moment, state renamed to torch.optim.AdamW's (exp_avg, exp_avg_sq, a float32 step tensor) and its
  groups' fields, torch.save.
- optstate: the CLI, no Python, no bitsandbytes.
Both outputs are read back with torch.load(weights_only=True) and must hold the same steps and
moments, bit for bit, and the same hyperparameters.

    .venv/bin/python bench/bench_bnb.py [--layers 2] [--reps 2] [--dir /tmp] [--json bench/results/bnb.json]
"""
import sys
import textwrap
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_torchsave import state_dict_bench  # noqa: E402

warnings.filterwarnings("ignore")

MAKE = textwrap.dedent("""
    import logging, sys, warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch, bitsandbytes as bnb
    sys.path.insert(0, BENCH)
    from bench_ckpt import make_model
    out, layers = sys.argv[1], int(sys.argv[2])
    model = make_model(layers)
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    torch.save(opt.state_dict(), out)
""")

CONVERT_WITH_BNB = textwrap.dedent("""
    import logging, sys, warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import bitsandbytes.functional as F
    src, dst = sys.argv[1], sys.argv[2]
    sd = torch.load(src, weights_only=False)
    for i, st in sd["state"].items():
        q = st.pop("__bnb_optimizer_quant_state__", {})
        q.update(st)
        out = {"step": torch.tensor(float(q["step"]))}
        for n, k in (("1", "exp_avg"), ("2", "exp_avg_sq")):
            s = q["state" + n]
            out[k] = s if s.dtype != torch.uint8 else F.dequantize_blockwise(
                s, absmax=q["absmax" + n], code=q["qmap" + n], blocksize=256)
        sd["state"][i] = out
    for g in sd["param_groups"]:
        for k in ("alpha", "t_alpha", "t_beta3"):
            g.pop(k, None)
        g.update(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=True)
    torch.save(sd, dst)
""")


def main():
    state_dict_bench("bnb", MAKE, CONVERT_WITH_BNB, "torch + bitsandbytes", "bitsandbytes",
                     "bitsandbytes AdamW8bit")


if __name__ == "__main__":
    main()
