"""Moving a `torch.optim.AdamW` run into torchao's AdamW8bit (Hugging Face Trainer's
optim="adamw_torch_8bit"): its `optimizer.pt` quantized into the state_dict torchao's
`load_state_dict` takes, its moments as OptimState8bit. `optstate convert optimizer.pt ao.pt
--format torchao --to 8bit` next to the way it is done with torch and torchao installed, side by
side in one run on the same file and disk, cold page cache, each a fresh process; wall time and
peak RSS of each, and the raw copy as the floor.

- The file: a Llama-shaped stack (--layers pairs of 2048x4096 / 4096x2048 Linears), one
  torch.optim.AdamW step then random moments (bench_ckpt.fill_state), `torch.save(opt.state_dict())`
  as the Trainer saves it (params unnamed).
- torch + torchao: torch.load, each moment of a param torchao quantizes (>= 4096 elements, whole
  blocks of 256) into `OptimState8bit.zeros(...)` by torchao's own quantizing `copy_`, lr a float32
  tensor (torchao's), torch.save.
- optstate: the CLI, no Python, no torchao.
Both outputs are read back with torch.load(weights_only=True, torchao imported) and must hold the
same steps, codes, scales and maps, bit for bit, and the same hyperparameters.

    .venv/bin/python bench/bench_torchao.py [--layers 2] [--reps 2] [--dir /tmp] [--json bench/results/torchao.json]
"""
import sys
import textwrap
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_torchsave import state_dict_bench  # noqa: E402

warnings.filterwarnings("ignore")

MAKE = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    sys.path.insert(0, BENCH)
    from bench_ckpt import fill_state, make_model
    out, layers = sys.argv[1], int(sys.argv[2])
    model = make_model(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fill_state(model, opt)
    torch.save(opt.state_dict(), out)
""")

QUANTIZE_WITH_TORCHAO = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from torchao.optim.subclass_8bit import OptimState8bit
    src, dst = sys.argv[1], sys.argv[2]
    sd = torch.load(src, weights_only=True)
    for st in sd["state"].values():
        for k, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
            x = st.get(k)
            if x is not None and x.numel() >= 4096 and x.numel() % 256 == 0:
                q = OptimState8bit.zeros(x.shape, signed, 256, x.device)
                q.copy_(x)  # torchao's quantization: scale per block, nearest code
                st[k] = q
    for g in sd["param_groups"]:
        g["lr"] = torch.tensor(g["lr"], dtype=torch.float32)
    torch.save(sd, dst)
""")


def same_torchao_state_dicts(a, b):
    assert a["state"].keys() == b["state"].keys()
    n8 = 0
    for i in b["state"]:
        for k, y in b["state"][i].items():
            x = a["state"][i][k]
            assert type(x) is type(y), (i, k)
            if hasattr(y, "codes"):
                n8 += 1
                assert torch.equal(x.codes, y.codes) and torch.equal(x.scale, y.scale), (i, k)
                assert torch.equal(x.qmap, y.qmap) and x.block_size == y.block_size and x.signed == y.signed, (i, k)
            else:
                assert x.dtype == y.dtype and torch.equal(x, y), (i, k)
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert torch.equal(ga["lr"], gb["lr"]), (ga, gb)
        assert all(ga[k] == gb[k] for k in ("betas", "eps", "weight_decay", "amsgrad", "params")), (ga, gb)
    return f"{n8} OptimState8bit moments equal (codes, scales, maps) bit for bit, hyperparameters equal"


def main():
    import torchao.optim  # noqa: F401  (torch.load of the outputs rebuilds OptimState8bit through it)
    state_dict_bench("torchao", MAKE, QUANTIZE_WITH_TORCHAO, "torch + torchao", "torchao", "torch.optim.AdamW",
                     optstate_args=("--format", "torchao", "--to", "8bit"), compare=same_torchao_state_dicts,
                     target="torchao AdamW8bit")


if __name__ == "__main__":
    main()
