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
    args = checkpoint_args(layers=2, reps=2).parse_args()
    cli, work, env, scripts = prepare("bnb", args.dir, MAKE, CONVERT_WITH_BNB, needs="bitsandbytes")
    src = work / "optimizer.pt"
    t_make = run([sys.executable, scripts["make.py"], src, args.layers])
    src_bytes = os.path.getsize(src)
    print(f"source: {src_bytes / 1e9:.2f} GB optimizer.pt of bitsandbytes AdamW8bit ({args.layers} layer pairs, "
          f"made in {t_make:.0f} s); {os.cpu_count()} cpus, torch {torch.__version__}")

    dst = {"optstate": work / "plain_optstate.pt", "torch + bitsandbytes": work / "plain_bnb.pt"}
    cases = {
        "optstate": lambda out: [cli, "convert", src, out],
        "torch + bitsandbytes": lambda out: [sys.executable, scripts["convert_reference.py"], src, out],
    }
    times, peak = time_cases(cases, dst, src, args.reps, env)
    dst_bytes = os.path.getsize(dst["optstate"])
    buf = bytearray(max(src_bytes, dst_bytes))
    for rep in range(args.reps):
        times["floor (raw copy)"].append(raw_read(src, memoryview(buf)[:src_bytes]) +
                                         raw_write(work / "raw_copy", memoryview(buf)[:dst_bytes]))

    a = torch.load(dst["optstate"], weights_only=True)
    b = torch.load(dst["torch + bitsandbytes"], weights_only=True)
    assert a["state"].keys() == b["state"].keys()
    bad = [(i, k) for i in b["state"] for k in b["state"][i] if not same(b["state"][i][k], a["state"][i].get(k))]
    assert not bad, f"outputs differ: {bad[:8]}"
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert all(ga[k] == gb[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "params")), (ga, gb)
    print(f"outputs: {dst_bytes / 1e9:.2f} GB each; {sum(len(s) for s in b['state'].values())} state tensors "
          f"equal bit for bit, hyperparameters equal; torch.load(weights_only=True) reads both")
    report(args, work, times, peak, src_bytes, dst_bytes, reference="torch + bitsandbytes")


if __name__ == "__main__":
    main()
