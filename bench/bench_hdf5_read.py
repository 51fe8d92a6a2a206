"""Reading HDF5 checkpoints: `optstate validate` (every value read, every chunk's fletcher32 checked,
each chunk's stored size looked at first) next to h5py reading every dataset into NumPy (libhdf5
checks the same fletcher32 checksums), on the same files in one run, with a plain read of each
file's bytes from the page cache as the floor.

Files (fp32 AdamW state and weights, all fletcher32):
- `optstate`: `optstate convert --format hdf5` (chunks of whole rows, about 1 MiB);
- `h5py 1 KiB chunks`: the same datasets rewritten by h5py in chunks of 256 floats (a file of many
  small chunks: libhdf5 1.10's H5Dget_chunk_info_by_coord walks a dataset's whole chunk index for
  each chunk, which made this reader quadratic in the chunks of a dataset);
- `h5py auto chunks`: rewritten by h5py with `chunks=True`.
Two states: `wide` (one 4096x4096 Linear: 3 datasets of 16.7 M floats) and `many` (--many params of
4x4 and 4: 3 datasets each). Each cell: median of --reps seconds, ours / h5py, and the peak RSS of
the optstate process (libhdf5's metadata cache keeps each object header it reads decoded).

    .venv/bin/python bench/bench_hdf5_read.py [--many 30000] [--reps 3] [--json bench/results/hdf5_read.json]
        [--cli other/build/optstate]
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
import optstate  # noqa: E402

CLI = ROOT / "build" / "optstate"


def save_state(model, out):
    opt = optstate.FusedAdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    optstate.save(out / "native", model, opt)
    run_cli("convert", out / "native", out / "optstate.h5", "--format", "hdf5", "--overwrite")


def rewrite(src, dst, chunks):
    """src's groups, attributes and values, each dataset rewritten by h5py with these chunks; in
    h5py's default file format (chunks indexed by a version 1 B-tree) unless the root's metadata
    attribute is past its 64 KiB limit (then the 1.10 format, as optstate writes)."""
    with h5py.File(src, "r") as s:
        big = max(len(str(v)) for v in s.attrs.values()) > 60000
    with h5py.File(src, "r") as s, h5py.File(dst, "w", libver=("v110", "v110") if big else "earliest") as d:
        d.attrs.update(s.attrs)

        def copy(name, obj):
            if isinstance(obj, h5py.Group):
                d.require_group(name).attrs.update(obj.attrs)
                return
            shape = chunks(obj.shape)
            ds = d.create_dataset(name, data=obj[...], chunks=shape, fletcher32=True)
            ds.attrs.update(obj.attrs)
        s.visititems(copy)


def run_cli(*args):
    """Seconds and peak RSS (KiB, or None) of one optstate run. The RSS comes from GNU time, which
    runs it: a child forked from this process (torch and the state in it) would count this
    process's pages in its own peak."""
    gnu_time = shutil.which("time")  # the program (Debian's `time`), not the shell's keyword
    with tempfile.NamedTemporaryFile("r") as rss:
        cmd = ([gnu_time, "-f", "%M", "-o", rss.name] if gnu_time else []) + [str(CLI), *map(str, args)]
        t = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - t
        if proc.returncode != 0:
            sys.exit(f"optstate {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
        kib = rss.read().strip().splitlines()
    return seconds, int(kib[-1]) if gnu_time and kib else None


def h5py_read_all(path):
    t = time.perf_counter()
    values = 0
    with h5py.File(path, "r") as f:
        def read(name, obj):
            nonlocal values
            if isinstance(obj, h5py.Dataset):
                values += obj[...].size
        f.visititems(read)
    return time.perf_counter() - t, values


def plain_read(path):
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t


def main():
    global CLI
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--many", type=int, default=30000, help="params of the 'many' state")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cli", type=Path, default=CLI, help="the optstate binary timed (another build's, to compare)")
    args = ap.parse_args()
    CLI = args.cli
    torch.manual_seed(0)
    states = {"wide": torch.nn.Linear(4096, 4096, bias=False),
              "many": torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(args.many // 2)])}
    layouts = {"h5py 1 KiB chunks": lambda shape: tuple([1] * (len(shape) - 1) + [min(shape[-1], 256)]),
               "h5py auto chunks": lambda shape: True}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for state, model in states.items():
            work = Path(tmp) / state
            work.mkdir()
            save_state(model, work)
            files = {"optstate": work / "optstate.h5"}
            for name, chunks in layouts.items():
                files[name] = work / (name.replace(" ", "_") + ".h5")
                rewrite(files["optstate"], files[name], chunks)
            for name, path in files.items():
                ours, theirs, floor, rss = [], [], [], None
                for _ in range(args.reps):  # round-robin: the machine's drift hits each alike
                    seconds, kib = run_cli("validate", path)
                    ours.append(seconds)
                    rss = kib if rss is None or kib is None else max(rss, kib)
                    seconds, values = h5py_read_all(path)
                    theirs.append(seconds)
                    floor.append(plain_read(path))
                row = {"state": state, "file": name, "bytes": path.stat().st_size, "values": values,
                       "optstate validate s": statistics.median(ours), "h5py read s": statistics.median(theirs),
                       "plain read s": statistics.median(floor), "optstate peak RSS MiB": rss and rss / 1024}
                rows.append(row)
                print(f"{state:5} {name:18} {row['bytes'] / 1e6:8.1f} MB  optstate validate "
                      f"{row['optstate validate s']:7.3f} s  h5py read {row['h5py read s']:7.3f} s  "
                      f"ours/h5py {row['optstate validate s'] / row['h5py read s']:5.2f}  plain read "
                      f"{row['plain read s']:6.3f} s ({row['bytes'] / row['plain read s'] / 1e9:5.2f} GB/s)  "
                      f"optstate RSS {row['optstate peak RSS MiB'] or 0:6.0f} MiB", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "h5py": h5py.__version__,
                                         "libhdf5": h5py.version.hdf5_version, "reps": args.reps, "rows": rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
