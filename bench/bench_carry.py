"""Turning a training loop's own checkpoint of torchao's AdamW8bit into one the same loop resumes
with plain torch.optim.AdamW: nanoGPT's `torch.save({"model": model.state_dict(), "optimizer":
opt.state_dict(), "iter_num": ..., "config": ...})`, params unnamed, in decay / no-decay groups.
`optstate convert ckpt.pt plain.pt` (the params named from the model beside them, the state
dequantized, everything else in the file carried) next to the way it is done with torch and
torchao installed, side by side in one run on the same file and disk, cold page cache, each a
fresh process; wall time and peak RSS of each, and the raw copy as the floor.

- The file: a Llama-shaped stack (--layers pairs of 2048x4096 / 4096x2048 Linears), a LayerNorm
  and a persistent buffer; one torchao AdamW8bit step (block 256).
- torch + torchao: torch.load (it needs torchao to rebuild the subclass), each moment dequantized,
  lr as a float, the whole dict torch.save'd again.
- optstate: the CLI, no Python, no torchao.
Both outputs are read back with torch.load(weights_only=True) and must hold the same entries: the
model's tensors, `iter_num` and `config` equal, and the same steps and moments, bit for bit, and
hyperparameters.

    .venv/bin/python bench/bench_carry.py [--layers 2] [--reps 2] [--dir /tmp] [--json bench/results/carry.json]
"""
import sys
import textwrap
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_torchsave import same_adamw_state_dicts, state_dict_bench  # noqa: E402

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
    model.add_module("norm", torch.nn.LayerNorm(2048))
    model.register_buffer("tokens_seen", torch.zeros(1))
    params = list(model.parameters())
    opt = AdamW8bit([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                     {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3, block_size=256)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 1000,
                "config": {"layers": layers, "lr": 1e-3}}, out)
""")

CONVERT_WITH_TORCHAO = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torchao.optim  # noqa: F401  (torch.load rebuilds OptimState8bit through it)
    src, dst = sys.argv[1], sys.argv[2]
    ck = torch.load(src, weights_only=False)
    sd = ck["optimizer"]
    for st in sd["state"].values():
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k in st and hasattr(st[k], "dequantize"):
                st[k] = st[k].dequantize()
    for g in sd["param_groups"]:
        g["lr"] = float(g["lr"])
    torch.save(ck, dst)
""")


def same_checkpoints(a, b):
    """The whole files: the same keys, the model's tensors and the loop's values equal, and the
    optimizers' state as same_adamw_state_dicts compares it."""
    assert list(a) == list(b), (list(a), list(b))
    assert list(a["model"]) == list(b["model"]) and all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    assert a["iter_num"] == b["iter_num"] and a["config"] == b["config"]
    return f"{len(b['model'])} model tensors and the loop's entries equal; " + same_adamw_state_dicts(
        a["optimizer"], b["optimizer"])


def main():
    state_dict_bench("carry", MAKE, CONVERT_WITH_TORCHAO, "torch + torchao", "torchao",
                     "a training loop's ckpt.pt of torchao AdamW8bit", compare=same_checkpoints)


if __name__ == "__main__":
    main()
