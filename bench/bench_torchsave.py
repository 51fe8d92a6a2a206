"""Turning Hugging Face Trainer's `optimizer.pt` of torchao's AdamW8bit (a torch.save'd
state_dict whose moments are OptimState8bit subclasses) into one that plain torch.optim.AdamW
loads: `optstate convert optimizer.pt plain.pt` next to the way it is done with torch and torchao
installed, side by side in one run on the same file and disk, cold page cache, each a fresh
process; wall time and peak RSS of each, and the raw copy as the floor.

- The file: a Llama-shaped stack (--layers pairs of 2048x4096 / 4096x2048 Linears), one torchao
  AdamW8bit step (block 256), `torch.save(opt.state_dict(), ...)` as the Trainer saves it (params
  unnamed, lr a tensor as torchao keeps it).
- torch + torchao: torch.load (it needs torchao to rebuild the subclass), dequantize each moment,
  lr as a float, torch.save.
- optstate: the CLI, no Python, no torchao.
Both outputs are read back with torch.load(weights_only=True) and must hold the same steps and
moments, bit for bit, and the same hyperparameters.

    .venv/bin/python bench/bench_torchsave.py [--layers 2] [--reps 2] [--dir /tmp] [--json bench/results/torchsave.json]
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
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    sys.path.insert(0, BENCH)
    from bench_ckpt import make_model
    from torchao.optim import AdamW8bit
    out, layers = sys.argv[1], int(sys.argv[2])
    model = make_model(layers)
    opt = AdamW8bit(model.parameters(), lr=1e-3, block_size=256)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    torch.save(opt.state_dict(), out)
""")

CONVERT_WITH_TORCHAO = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torchao.optim  # noqa: F401  (torch.load rebuilds OptimState8bit through it)
    src, dst = sys.argv[1], sys.argv[2]
    sd = torch.load(src, weights_only=False)
    for st in sd["state"].values():
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k in st and hasattr(st[k], "dequantize"):
                st[k] = st[k].dequantize()
    for g in sd["param_groups"]:
        g["lr"] = float(g["lr"])
    torch.save(sd, dst)
""")


def same_adamw_state_dicts(a, b):
    """Two torch.optim.AdamW state_dicts hold the same steps and moments, bit for bit, and the same
    hyperparameters; a description of what was compared."""
    assert a["state"].keys() == b["state"].keys()
    bad = [(i, k) for i in b["state"] for k in b["state"][i] if not same(b["state"][i][k], a["state"][i].get(k))]
    assert not bad, f"outputs differ: {bad[:8]}"
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert all(ga[k] == gb[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "params")), (ga, gb)
    return f"{sum(len(s) for s in b['state'].values())} state tensors equal bit for bit, hyperparameters equal"


def state_dict_bench(name, make, convert_reference, reference, needs, source, optstate_args=(),
                     compare=same_adamw_state_dicts, target="torch.optim.AdamW"):
    """One run of a state_dict convert benchmark: `make` writes SRC (an optimizer.pt of `source`),
    `convert_reference` turns it into `target`'s state_dict the `reference` way (with torch and
    `needs`), optstate's CLI (`convert SRC DST *optstate_args`) the other; times, peak RSS, the raw
    copy, both outputs read back and checked by `compare(optstate's, reference's)`."""
    args = checkpoint_args(layers=2, reps=2).parse_args()
    cli, work, env, scripts = prepare(name, args.dir, make, convert_reference, needs=needs)
    src = work / "optimizer.pt"
    t_make = run([sys.executable, scripts["make.py"], src, args.layers])
    src_bytes = os.path.getsize(src)
    print(f"source: {src_bytes / 1e9:.2f} GB optimizer.pt of {source} ({args.layers} layer pairs, "
          f"made in {t_make:.0f} s); {os.cpu_count()} cpus, torch {torch.__version__}")

    dst = {"optstate": work / "out_optstate.pt", reference: work / "out_reference.pt"}
    cases = {
        "optstate": lambda out: [cli, "convert", src, out, *optstate_args],
        reference: lambda out: [sys.executable, scripts["convert_reference.py"], src, out],
    }
    times, peak = time_cases(cases, dst, src, args.reps, env)
    dst_bytes = os.path.getsize(dst["optstate"])
    buf = bytearray(max(src_bytes, dst_bytes))
    for rep in range(args.reps):
        times["floor (raw copy)"].append(raw_read(src, memoryview(buf)[:src_bytes]) +
                                         raw_write(work / "raw_copy", memoryview(buf)[:dst_bytes]))

    checked = compare(torch.load(dst["optstate"], weights_only=True), torch.load(dst[reference], weights_only=True))
    print(f"outputs: {dst_bytes / 1e9:.2f} GB each, {target}'s state_dict; {checked}; "
          f"torch.load(weights_only=True) reads both")
    report(args, work, times, peak, src_bytes, dst_bytes, reference=reference)


def main():
    state_dict_bench("torchsave", MAKE, CONVERT_WITH_TORCHAO, "torch + torchao", "torchao", "torchao AdamW8bit")


if __name__ == "__main__":
    main()
