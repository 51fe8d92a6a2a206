"""Turning a torchtitan checkpoint of torchao's AdamW8bit into one of plain fp32 torch.optim.AdamW,
same layout, everything else kept (DCP -> DCP): `optstate convert SRC DST --format dcp --to fp32` next to the
way it is done with torch and torchao installed, side by side in one run on the same checkpoint and
disk, cold page cache, each a fresh process as a user runs it; wall time and peak RSS of each.

- The checkpoint: a Llama-shaped stack (--layers pairs of 2048x4096 / 4096x2048 Linears), one
  torchao AdamW8bit step (block 256), saved as torchtitan's CheckpointManager saves it: weights at
  the top level, the optimizer flattened under "optimizer", lr_scheduler, train_state, dataloader.
- torch + torchao: build the model, AdamW8bit and LambdaLR, strict dcp.load of torchtitan's state
  dict, dequantize each moment into torch.optim.AdamW's state (lr as a tensor, as torchao keeps it),
  dcp.save of the same state dict layout.
- optstate: the CLI, no Python, no torchao.
- floor: read SRC's bytes cold, write DST's byte count and fsync (bench_ckpt's raw helpers).
Both outputs are read back with torch's dcp_to_torch_save and compared: weights, moments, steps,
LR-scheduler, train_state and dataloader items must be equal, bit for bit.

    .venv/bin/python bench/bench_dcp_convert.py [--layers 2] [--reps 2] [--dir /tmp] [--json bench/results/dcp_convert.json]
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from bench_ckpt import (checkpoint_args, dir_bytes, drop_cache, raw_read, raw_write, run_measured,  # noqa: E402
                        write_json)

warnings.filterwarnings("ignore")

COMMON = textwrap.dedent("""
    import io, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
        get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
    sys.path.insert(0, BENCH)
    from bench_ckpt import make_model
    from torchao.optim import AdamW8bit
    OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
    OTHERS = ("optimizer", "lr_scheduler", "train_state", "dataloader")

    def lr_lambda(step):
        return 1.0 - 1e-3 * step

    def titan_states(model, opt, sched, train_state=None, dataloader=None):
        states = dict(get_model_state_dict(model))
        states["optimizer"] = get_optimizer_state_dict(model, opt, options=OPTS)
        states["lr_scheduler"] = sched.state_dict()
        states["train_state"] = train_state or {"step": torch.tensor(0, dtype=torch.int32),
                                                "global_avg_losses": io.BytesIO()}
        states["dataloader"] = dataloader or {"dp_rank_0": io.BytesIO()}
        return states
""")

MAKE = COMMON + textwrap.dedent("""
    out, layers = sys.argv[1], int(sys.argv[2])
    model = make_model(layers)
    opt = AdamW8bit(model.parameters(), lr=1e-3, block_size=256)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    sched.step()
    losses = io.BytesIO()
    torch.save([2.5, 2.25], losses)
    states = titan_states(model, opt, sched, {"step": torch.tensor(1, dtype=torch.int32), "global_avg_losses": losses},
                          {"dp_rank_0": io.BytesIO(b"sampler position 4096")})
    dcp.save(states, checkpoint_id=out)
""")

CONVERT_WITH_TORCHAO = COMMON + textwrap.dedent("""
    src, dst, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = make_model(layers)
    opt8 = AdamW8bit(model.parameters(), lr=1e-3, block_size=256)
    sched8 = torch.optim.lr_scheduler.LambdaLR(opt8, lr_lambda)
    states = titan_states(model, opt8, sched8)
    dcp.load(states, checkpoint_id=src)
    set_model_state_dict(model, {k: v for k, v in states.items() if k not in OTHERS})
    set_optimizer_state_dict(model, opt8, states["optimizer"], options=OPTS)
    sched8.load_state_dict(states["lr_scheduler"])
    g8 = opt8.param_groups[0]
    opt = torch.optim.AdamW(model.parameters(), lr=g8["lr"].clone(), betas=g8["betas"], eps=g8["eps"],
                            weight_decay=g8["weight_decay"])
    opt.param_groups[0]["initial_lr"] = g8["initial_lr"].clone()
    for p in model.parameters():
        s = opt8.state[p]
        opt.state[p] = {"step": s["step"].float().clone(), "exp_avg": s["exp_avg"].dequantize(),
                        "exp_avg_sq": s["exp_avg_sq"].dequantize()}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    sched.load_state_dict(sched8.state_dict())
    dcp.save(titan_states(model, opt, sched, states["train_state"], states["dataloader"]), checkpoint_id=dst)
""")


def run(cmd):
    t0 = time.perf_counter()
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{proc.stderr[-3000:]}")
    return dt


def flat(obj, prefix=""):
    """Leaves of a nested state dict by dotted path."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, (list, tuple)) and any(isinstance(x, (torch.Tensor, dict)) for x in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: obj}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if hasattr(a, "getvalue"):
        return hasattr(b, "getvalue") and a.getvalue() == b.getvalue()
    return a == b


def prepare(name, where, make, convert_reference, needs="torchao"):
    """What a convert benchmark needs before it runs: the CLI, a work folder under `where`, the
    environment of its child processes, and its two scripts (make.py, and convert_reference.py: the
    way it is done with torch and `needs` installed) written there."""
    try:
        __import__(needs)
    except ImportError:
        sys.exit(f"{needs} is needed for the reference side")
    cli = REPO / "build" / "optstate"
    if not cli.exists():
        sys.exit(f"{cli} is not built")
    work = Path(tempfile.mkdtemp(prefix=f"optstate-bench-{name}-", dir=where))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    prelude = f"BENCH = {str(BENCH)!r}\n"
    scripts = {}
    for script, text in (("make.py", make), ("convert_reference.py", convert_reference)):
        scripts[script] = work / script
        scripts[script].write_text(prelude + text)
    return cli, work, env, scripts


def time_cases(cases, dst, src, reps, env):
    """Runs each case `reps` times, rotating, each a fresh process on a cold SRC writing its DST
    (removed first); wall seconds per run and the peak RSS over the runs, by case. The times leave
    room for the floor's ("floor (raw copy)")."""
    times = {k: [] for k in list(cases) + ["floor (raw copy)"]}
    peak = {k: 0 for k in cases}
    for rep in range(reps):
        for k, make_cmd in cases.items():
            if os.path.isdir(dst[k]):
                shutil.rmtree(dst[k])
            elif os.path.exists(dst[k]):
                os.unlink(dst[k])
            drop_cache(src)
            seconds, rss = run_measured(make_cmd(dst[k]), env)
            times[k].append(seconds)
            peak[k] = max(peak[k], rss)
    return times, peak


def time_floor(times, src, work, src_bytes, dst_bytes, reps):
    """The floor of a convert benchmark, `reps` times into times["floor (raw copy)"]: SRC's files read
    cold, DST's byte count written and fsynced."""
    buf = bytearray(max(src_bytes, dst_bytes))
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs]
    for rep in range(reps):
        t = 0.0
        for f in files:
            t += raw_read(f, memoryview(buf)[:os.path.getsize(f)])
        t += raw_write(work / "raw_copy", memoryview(buf)[:dst_bytes])
        times["floor (raw copy)"].append(t)


def writer_args(layers, stack, help, extra=None):
    """The command line of a training stack's convert benchmark: the checkpoint's size (--layers,
    --hidden, --vocab, with bench_ckpt's --reps, --dir, --json) and --<stack>, where it imports;
    `extra(parser)` adds a benchmark's own."""
    from bench_ckpt import checkpoint_args
    ap = checkpoint_args(layers=layers, reps=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument(f"--{stack}", required=True, help=help)
    if extra:
        extra(ap)
    return ap.parse_args()


def writer_fp32_bench(args, cli, work, env, scripts, make, src, what, reference, contents, read=None, expected=None,
                      reference_args=()):
    """The run a training stack's convert benchmark shares (bench_megatron.py, bench_nanotron.py):
    `make` (a command that writes the stack's checkpoint SRC, timed), the source line, then
    `optstate convert SRC --to fp32` and the reference script (scripts["convert_reference.py"]) side
    by side, the floor reading `read` (what of SRC the conversion reads; SRC by default), both
    outputs compared bit for bit (`contents` says what they hold), the table and the JSON. With
    `expected` (a safetensors file the writer made), optstate's output is compared with that
    instead (a reference that cannot give per-param tensors is only timed); `reference_args` follow
    the reference script's SRC and DST."""
    import subprocess
    import time

    import torch
    from bench_ckpt import dir_bytes
    from safetensors.torch import load_file
    t0 = time.perf_counter()
    subprocess.run(make, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    made = time.perf_counter() - t0
    read = read or src
    src_bytes = dir_bytes(read)
    info = subprocess.run([cli, "inspect", src, "--no-stats"], capture_output=True, text=True, check=True).stdout
    params = info.splitlines()[1].split(",", 2)[-1].strip()
    print(f"source: {src_bytes / 1e9:.2f} GB {what} ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: "
          f"{params}; made in {made:.0f} s); {os.cpu_count()} cpus, torch {torch.__version__}")
    dst = {"optstate": work / "optstate.safetensors", reference: work / "reference.safetensors"}
    cases = {
        "optstate": lambda out: [cli, "convert", src, out, "--to", "fp32"],
        reference: lambda out: [sys.executable, scripts["convert_reference.py"], src, out, *reference_args],
    }
    times, peak = time_cases(cases, dst, src, args.reps, env)
    dst_bytes = os.path.getsize(dst["optstate"])
    time_floor(times, read, work, src_bytes, dst_bytes, args.reps)
    a, b = load_file(dst["optstate"]), load_file(expected or dst[reference])
    bad = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
    assert not bad, f"outputs differ: {bad[:8]}"
    against = f"the writer's own {Path(expected).name}" if expected else reference + "'s"
    print(f"outputs: {dst_bytes / 1e9:.2f} GB; {len(b)} tensors equal bit for bit to {against} ({contents})")
    report(args, work, times, peak, src_bytes, dst_bytes, reference=reference)


def report(args, work, times, peak, src_bytes, dst_bytes, reference="torch + torchao"):
    """The end of a convert benchmark: its table, the work folder removed, the JSON written."""
    rows = convert_table(times, peak, src_bytes, dst_bytes, reference)
    shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, {"layers": args.layers, "src_bytes": src_bytes, "dst_bytes": dst_bytes,
                           "reps": args.reps, "reference": reference, "results": rows})


def convert_table(times, peak, src_bytes, dst_bytes, reference="torch + torchao"):
    """Prints the table of a convert benchmark (cases "optstate", the `reference` one and the floor,
    "floor (raw copy)") and returns its rows for the JSON."""
    med = {k: statistics.median(v) for k, v in times.items()}
    moved = src_bytes + dst_bytes
    width = max(18, max(map(len, times)) + 2)
    key = "speedup_vs_torchao" if reference == "torch + torchao" else "speedup_vs_reference"
    print(f"\n{'case':<{width}}{'median s':>10}{'best s':>9}{'GB/s':>7}{'% floor':>9}{'vs ' + reference:>{len(reference) + 5}}"
          f"{'peak RSS GB':>13}{'RSS / SRC':>11}")
    rows = {}
    for k in times:
        rows[k] = {"median_s": med[k], "best_s": min(times[k]), "gb_per_s": moved / med[k] / 1e9,
                   "pct_floor": 100 * med["floor (raw copy)"] / med[k],
                   key: med[reference] / med[k], "peak_rss_bytes": peak.get(k)}
        r = rows[k]
        rss = f"{peak[k] / 1e9:>13.3f}{peak[k] / src_bytes:>11.2f}" if k in peak else f"{'-':>13}{'-':>11}"
        print(f"{k:<{width}}{med[k]:>10.2f}{min(times[k]):>9.2f}{r['gb_per_s']:>7.2f}{r['pct_floor']:>8.0f}%"
              f"{r[key]:>{len(reference) + 4}.2f}x{rss}")
    print("(GB/s: bytes read + written; each case a fresh process, cold page cache for SRC; peak RSS: the\n"
          " process's high-water resident memory, the largest over the runs)")
    return rows


def main():
    args = checkpoint_args(layers=2, reps=2).parse_args()
    cli, work, env, scripts = prepare("dcpconv", args.dir, MAKE, CONVERT_WITH_TORCHAO)
    src = work / "src"
    t_make = run([sys.executable, scripts["make.py"], src, args.layers])
    src_bytes = dir_bytes(src)
    print(f"source: {src_bytes / 1e9:.2f} GB torchtitan DCP of torchao AdamW8bit ({args.layers} layer pairs, "
          f"made in {t_make:.0f} s); {os.cpu_count()} cpus, torch {torch.__version__}")

    dst = {"optstate": work / "dst_optstate", "torch + torchao": work / "dst_torchao"}
    cases = {
        "optstate": lambda out: [cli, "convert", src, out, "--format", "dcp", "--to", "fp32"],
        "torch + torchao": lambda out: [sys.executable, scripts["convert_reference.py"], src, out, args.layers],
    }
    times, peak = time_cases(cases, dst, src, args.reps, env)
    dst_bytes = dir_bytes(dst["optstate"])
    time_floor(times, src, work, src_bytes, dst_bytes, args.reps)

    # Both outputs hold the same state, read by torch's own DCP reader.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(dst["optstate"], work / "a.pt")
    dcp_to_torch_save(dst["torch + torchao"], work / "b.pt")
    a = flat(torch.load(work / "a.pt", weights_only=False))
    b = flat(torch.load(work / "b.pt", weights_only=False))
    compared = [k for k in b if k.startswith(("optimizer.state.", "lr_scheduler.", "train_state.", "dataloader."))
                or not k.startswith("optimizer.")]
    bad = [k for k in compared if k not in a or not same(a[k], b[k])]
    assert not bad, f"outputs differ: {bad[:8]}"
    groups = [k for k in b if k.startswith("optimizer.param_groups.")]
    assert all(k in a for k in groups), [k for k in groups if k not in a][:8]
    print(f"outputs: {dst_bytes / 1e9:.2f} GB each; {len(compared)} items equal bit for bit "
          f"(weights, moments, steps, lr_scheduler, train_state, dataloader); every param_groups field present")

    report(args, work, times, peak, src_bytes, dst_bytes)


if __name__ == "__main__":
    main()
