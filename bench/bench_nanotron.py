"""Reading nanotron's ZeRO-1 checkpoint into plain fp32 per-param state: `optstate convert <step>
plain.safetensors --to fp32` next to torch alone doing it (`torch.load` of each data-parallel rank's
optimizer file, each param's runs concatenated in rank order as optimizer_config.json places them and
reshaped to its shape, then safetensors' `save_file`), side by side in one run on the same checkpoint
and disk, cold page cache, each a fresh process; wall time and peak RSS of each, and the raw copy as
the floor. torch's side reads tensors only: it knows no param groups or steps, which optstate reads
besides (`inspect`).

- The checkpoint: nanotron's LlamaForTraining (--layers, --hidden, --vocab; bf16 weights, fp32
  gradient accumulation) trained 3 steps with ZeRO-1 over 2 CPU ranks (gloo) and saved by nanotron
  itself (`tests/data/writers/make_nanotron.py`, run `dp2_zero1`).
- nanotron must import: --nanotron PATH (its source tree's src/, with dacite, pyyaml and tqdm on the
  same path: see make_nanotron.py), used for making the checkpoint only.
The two outputs must hold the same fp32 tensors, bit for bit (fp32 weights, exp_avg, exp_avg_sq).

    .venv/bin/python bench/bench_nanotron.py --nanotron /tmp/nanotron/src:/tmp/ntdeps [--layers 8]
        [--hidden 1024] [--vocab 32768] [--reps 2] [--dir /tmp] [--json bench/results/nanotron.json]
"""
import sys
import textwrap
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_dcp_convert import prepare, writer_args, writer_fp32_bench  # noqa: E402

warnings.filterwarnings("ignore")

# torch alone: each rank's file loaded whole, each param's runs put together by the config.
READ_WITH_TORCH = textwrap.dedent("""
    import json, sys, warnings
    from pathlib import Path
    warnings.filterwarnings("ignore")
    import torch
    from safetensors.torch import save_file
    src, out = Path(sys.argv[1]) / "optimizer", sys.argv[2]
    config = json.loads((src / "optimizer_config.json").read_text())
    runs = config["configs"]["param_name_to_dp_rank_offsets"]
    shapes = {k: [int(x) for x in v] for k, v in config["configs"]["orig_param_shapes"].items()}
    dp = int(config["parallelism"]["dp_size"])
    parts = {}
    for rank in range(dp):
        sd = torch.load(src / f"optimizer_pp-0-of-1_dp-{rank}-of-{dp}_tp-0-of-1_exp-0-of-1.pt", weights_only=False)
        for index, name in sd["names"].items():
            st = sd["state"][index]
            for entry, t in (("param", sd["gradient_accumulator"][name]), ("exp_avg", st["exp_avg"]),
                             ("exp_avg_sq", st["exp_avg_sq"])):
                parts.setdefault(f"{name}.{entry}", []).append((int(runs[name][str(rank)][0]), t))
    named = {}
    for key, pieces in parts.items():
        name = key.rsplit(".", 1)[0]
        named[key] = torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]).float().reshape(shapes[name])
    save_file(named, out)
""")


def main():
    args = writer_args(8, "nanotron", "PYTHONPATH where nanotron imports (its src/ and deps)")
    cli, work, env, scripts = prepare("nanotron", args.dir, "", READ_WITH_TORCH, needs="safetensors")
    make_env = dict(env, PYTHONPATH=args.nanotron, NANOTRON_SIZE=f"{args.layers},{args.hidden},{args.vocab}",
                    NANOTRON_RUNS="dp2_zero1", NANOTRON_REF="0")
    make = [sys.executable, str(BENCH.parent / "tests/data/writers/make_nanotron.py"), work / "made"]
    src = work / "made" / "dp2_zero1"
    writer_fp32_bench(args, cli, work, make_env, scripts, make, src, "of nanotron ZeRO-1 optimizer files", "torch.load",
                      "fp32 weights, exp_avg, exp_avg_sq", read=src / "optimizer")

if __name__ == "__main__":
    main()
