"""Checkpoint save/load: optstate (native, sharded format) vs PyTorch DCP (dcp.save / dcp.load) on the
same optimizer state and the same disk, side by side in one run, against the raw sequential
bandwidth of that disk measured in the same run.

State: a Llama-shaped model (default ~134M fp32 params) with AdamW moments: 1.07 GB of fp32 moments
plus 0.54 GB of weights, 1.61 GB per checkpoint. Both sides save the same tensors (model weights
and exp_avg / exp_avg_sq / step) and make them durable (fsync; DCP's default sync_files=True).

- save: from live tensors to a durable checkpoint in a fresh directory (each side's own commit
  protocol; the previous one is removed before the clock starts, for both).
- load (cold): page cache dropped for the checkpoint's files first (posix_fadvise DONTNEED after an
  fsync, no root needed), then into a live optimizer's existing state (DCP: dcp.load into the
  state dict of an existing model + torch.optim.AdamW, then load_state_dict; optstate:
  optstate.load into FusedAdamW, which reads into the existing tensors in place). optstate also
  verifies every chunk's XXH3 on the way; DCP has no checksums. "optstate load" is the default,
  transactional load (the whole checkpoint read and verified before any live byte changes, then
  read again, mostly from the page cache); "optstate-1pass load" is transactional=False.
- raw: one file of the same size written with 64 MiB writes + fsync, and read back cold with
  64 MiB reads into one preallocated buffer: the floor for both.
Timed round-robin (one of each in turn), median of --reps.

    .venv/bin/python bench/bench_ckpt.py [--layers 16] [--reps 3] [--dir /tmp] [--json bench/results/ckpt.json]
"""
import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import optstate  # noqa: E402

MiB = 1 << 20


def make_model(layers, hidden=2048, ffn=4096):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, ffn, bias=False), torch.nn.Linear(ffn, hidden, bias=False)]
    return torch.nn.Sequential(*mods)


def fill_state(model, opt):
    """One real step so the optimizer has its state, then random moments (a realistic entropy)."""
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    g = torch.Generator().manual_seed(1)
    for st in opt.state.values():
        st["exp_avg"].copy_(torch.randn(st["exp_avg"].shape, generator=g) * 1e-3)
        st["exp_avg_sq"].copy_(torch.rand(st["exp_avg_sq"].shape, generator=g) * 1e-6)


def drop_cache(path):
    """Evicts a file's or directory's pages from the page cache (clean pages only; fsync first)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# Runs a command from a small Python that forks it and reports its wall time and peak RSS. A child
# forked straight from this (large, torch-holding) process would start its peak RSS from ours: Linux
# keeps ru_maxrss across fork and exec.
_MEASURE = (
    "import os, sys, time\n"
    "t = time.perf_counter()\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "open(sys.argv[1], 'w').write(f'{time.perf_counter() - t} {usage.ru_maxrss * 1024}')\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n")


def run_measured(cmd, env=None):
    """(wall seconds, peak RSS bytes) of a command; exits with its stderr if it fails."""
    import subprocess
    with tempfile.NamedTemporaryFile(mode="r", suffix=".measure") as out:
        proc = subprocess.run([sys.executable, "-c", _MEASURE, out.name] + list(map(str, cmd)), capture_output=True,
                              text=True, env=env)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(map(str, cmd))} failed:\n{proc.stderr[-3000:]}")
        seconds, peak = out.read().split()
    return float(seconds), int(peak)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


_libc = ctypes.CDLL(None, use_errno=True)
SYNC_FILE_RANGE_WRITE = 2


def raw_write(path, buf, kick=False):
    """64 MiB writes + fsync; with `kick`, writeback of each written piece is started at once
    (sync_file_range), so the disk works while the rest is written (what optstate's writer does)."""
    if os.path.exists(path):
        os.unlink(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    mv = memoryview(buf)
    for off in range(0, len(mv), 64 * MiB):
        n = os.write(fd, mv[off:off + 64 * MiB])
        if kick:
            _libc.sync_file_range(fd, ctypes.c_int64(off), ctypes.c_int64(n), SYNC_FILE_RANGE_WRITE)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def raw_read(path, buf):
    drop_cache(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    mv = memoryview(buf)
    off = 0
    while off < len(mv):
        n = os.readv(fd, [mv[off:off + 64 * MiB]])
        if n == 0:
            break
        off += n
    os.close(fd)
    return time.perf_counter() - t0


def checkpoint_args(layers=8, reps=3):
    """The options of every checkpoint benchmark: model size, rounds, where to write, JSON output."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json")
    return ap


def write_json(path, doc):
    """A benchmark's results as JSON, where --json names a file."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1))


def main():
    args = checkpoint_args().parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="optstate-bench-ckpt-", dir=args.dir))

    model_o = make_model(args.layers)
    opt_o = optstate.FusedAdamW(model_o.parameters())
    fill_state(model_o, opt_o)
    model_t = make_model(args.layers)
    opt_t = torch.optim.AdamW(model_t.parameters(), fused=True)
    fill_state(model_t, opt_t)
    nparams = sum(p.numel() for p in model_o.parameters())
    total = 3 * 4 * nparams  # weights + two fp32 moments
    print(f"state: {nparams / 1e6:.1f}M fp32 params, moments {8 * nparams / 1e9:.2f} GB, "
          f"checkpoint {total / 1e9:.2f} GB; dir {work}; {os.cpu_count()} cpus, torch {torch.__version__}")

    # Targets to load into (preallocated, as a resuming job has them).
    model_o2 = make_model(args.layers)
    opt_o2 = optstate.FusedAdamW(model_o2.parameters())
    fill_state(model_o2, opt_o2)
    model_t2 = make_model(args.layers)
    opt_t2 = torch.optim.AdamW(model_t2.parameters(), fused=True)
    fill_state(model_t2, opt_t2)

    raw_buf = bytearray(total)
    raw_in = bytearray(total)

    def sd(model, opt):
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    cases = {
        "raw save": lambda: raw_write(work / "raw.bin", raw_buf),
        "raw+kick save": lambda: raw_write(work / "raw.bin", raw_buf, kick=True),
        "raw load": lambda: raw_read(work / "raw.bin", raw_in),
    }

    def o_save():
        shutil.rmtree(work / "optstate", ignore_errors=True)
        t0 = time.perf_counter()
        optstate.save(work / "optstate", model_o, opt_o, overwrite=False)
        return time.perf_counter() - t0

    def o_load(transactional=True):
        drop_cache(work / "optstate")
        t0 = time.perf_counter()
        optstate.load(work / "optstate", model_o2, opt_o2, transactional=transactional)
        return time.perf_counter() - t0

    def t_save():
        shutil.rmtree(work / "dcp", ignore_errors=True)
        t0 = time.perf_counter()
        dcp.save(sd(model_t, opt_t), checkpoint_id=str(work / "dcp"))
        return time.perf_counter() - t0

    def t_load():
        drop_cache(work / "dcp")
        target = sd(model_t2, opt_t2)
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=str(work / "dcp"))
        opt_t2.load_state_dict(target["optim"])
        return time.perf_counter() - t0

    cases.update({"optstate save": o_save, "optstate load": o_load, "dcp save": t_save, "dcp load": t_load,
                  "optstate-1pass load": lambda: o_load(transactional=False)})
    order = ["raw save", "raw+kick save", "optstate save", "dcp save", "raw load", "optstate load",
             "optstate-1pass load", "dcp load"]
    times = {k: [] for k in order}
    for rep in range(args.reps + 1):  # the first round warms up (allocations, imports)
        for k in order:
            t = cases[k]()
            if rep:
                times[k].append(t)
    # The loads really restored the saved state.
    for a, b in zip(model_o.parameters(), model_o2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt_o.state.values(), opt_o2.state.values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    for a, b in zip(opt_t.state.values(), opt_t2.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])

    sizes = {"raw": total, "raw+kick": total, "optstate": dir_bytes(work / "optstate"), "dcp": dir_bytes(work / "dcp")}
    sizes["optstate-1pass"] = sizes["optstate"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'case':<16}{'median s':>10}{'best s':>10}{'GB/s':>8}{'% raw':>8}{'vs dcp':>9}   bytes on disk")
    rows = {}
    for k in order:
        who, op = k.split()
        gbs = total / med[k] / 1e9
        raw = min(med[f"raw {op}"], med.get(f"raw+kick {op}", float("inf")))
        ratio = med[f"dcp {op}"] / med[k]
        rows[k] = {"median_s": med[k], "best_s": min(times[k]), "gb_per_s": gbs, "pct_raw": 100 * raw / med[k],
                   "speedup_vs_dcp": ratio, "bytes": sizes[who]}
        print(f"{k:<16}{med[k]:>10.3f}{min(times[k]):>10.3f}{gbs:>8.2f}{100 * raw / med[k]:>7.0f}%"
              f"{ratio:>8.2f}x   {sizes[who] / 1e9:.3f} GB")
    print("\nGB/s counts the state's bytes (weights + moments); '% raw' = the faster raw time / case time; "
          "'vs dcp' = dcp time / case time.")
    shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, {"machine": platform.platform(), "cpus": os.cpu_count(), "params": nparams,
                           "bytes": total, "reps": args.reps, "results": rows})


if __name__ == "__main__":
    main()
