"""Hashing and validating a checkpoint: `optstate hash` / `validate` vs hashing the same state in
Python with torch, side by side in one run on the same disk, next to the raw read of its bytes.

The checkpoint: a Llama-shaped model (default ~134M fp32 params) with torch.optim.AdamW state saved
by get_state_dict + dcp.save (1.6 GB), and the same state converted to optstate's native format.
Every case is a fresh process, timed with its peak RSS, cold (the files dropped from the page cache
with posix_fadvise DONTNEED; on a VM see go_cold) and then warm:
- raw read: `cat` of every file of the DCP. Warm, it is the floor (the page cache's copy bandwidth:
  "% raw"). Cold it is shown but is no floor on this VM: the same 1.6 GB took cat and dd 0.8-4.2 s,
  most often slower than optstate's hash, whose 8 MiB preads with hashing between them keep the
  disk's readahead busier; so cold cases are compared with the torch reference only;
- optstate hash DCP / native, `hash --values` on the DCP, `validate` native (every chunk's XXH3
  recomputed, values checked for NaN/inf and exp_avg_sq >= 0);
- torch + xxhash: what a script does without optstate -- load every item of the DCP
  (`_load_state_dict_from_keys`, torch's own loader) and XXH3-128 each tensor's bytes; its fixed
  cost (a process importing Python, torch and the loader) is shown on a line of its own.
The two hash definitions differ (optstate's hashes entries by name, shape and encoding and is the
same for every format and sharding, docs/hash.md); the cost of reading and hashing every byte is
what is compared. The bench checks that optstate's DCP and native hashes agree.
Median of --reps, round-robin, each round starting at another case.

    .venv/bin/python bench/bench_hash.py [--layers 8] [--reps 3] [--dir /tmp] [--json bench/results/hash.json]
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ckpt import (checkpoint_args, dir_bytes, drop_cache, fill_state, make_model, run_measured,  # noqa: E402
                        write_json)

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "build" / "optstate"

# The Python reference: torch loads every item, xxhash hashes every tensor's bytes.
TORCH_HASH = """
import sys, warnings, torch, xxhash
warnings.filterwarnings("ignore")
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
state = _load_state_dict_from_keys(checkpoint_id=sys.argv[1])
def walk(prefix, obj, out):
    if isinstance(obj, dict):
        for k, v in obj.items():
            walk(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            walk(f"{prefix}.{i}", v, out)
    elif isinstance(obj, torch.Tensor):
        out[prefix] = xxhash.xxh3_128_hexdigest(obj.reshape(-1).contiguous().view(torch.uint8).numpy())
hashes = {}
walk("", state, hashes)
root = xxhash.xxh3_128()
for k in sorted(hashes):
    root.update(f"{hashes[k]}  {k}\\n".encode())
print(root.hexdigest(), len(hashes))
"""


CAT_ALL = ["sh", "-c", 'cat "$@" > /dev/null', "sh"]  # + the files


def files_under(path):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def raw_read_all(path, cold):
    """cat reads every file under `path` (sequential 128 KiB reads, the kernel's readahead ahead of
    them); (seconds, peak RSS). On this VM that is the fastest plain reader: 8 MiB reads with nothing
    between them (dd bs=8M) ran 1.5-3x slower cold, as the readahead window is 8 MiB here."""
    if cold:
        go_cold(path)
    return run_measured(CAT_ALL + files_under(path))


def go_cold(path):
    """Drops `path` from this machine's page cache, after one untimed read. On a VM the host may
    still cache what the guest dropped, so which case ran first would decide who reads the real disk;
    reading first makes every cold case start alike: out of the guest's cache, in the host's."""
    subprocess.run(CAT_ALL + files_under(path), check=True)
    drop_cache(path)


def main():
    args = checkpoint_args().parse_args()
    if not CLI.exists():
        sys.exit(f"{CLI} not found: build first (README)")
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="optstate-bench-hash-", dir=args.dir))
    ck, native = work / "dcp", work / "native"
    model = make_model(args.layers)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    fill_state(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ck))
    del model, opt, msd, osd
    subprocess.run([CLI, "convert", ck, native, "--format", "native"], check=True, capture_output=True)
    total = dir_bytes(ck)
    script = work / "torch_hash.py"
    script.write_text(TORCH_HASH)
    print(f"checkpoint: {total / 1e9:.2f} GB (DCP; native {dir_bytes(native) / 1e9:.2f} GB) in {work}; "
          f"{os.cpu_count()} cpus, torch {torch.__version__}")

    roots = {}

    def cli(*cmd, path, root_of=None):
        def run(cold):
            if cold:
                go_cold(path)
            seconds, peak = run_measured([CLI, *cmd])
            if root_of and root_of not in roots:  # the root hash, from a run outside the timing
                out = subprocess.run([CLI, *cmd], check=True, capture_output=True, text=True).stdout
                roots[root_of] = out.strip().splitlines()[-1].split()[0]
            return seconds, peak
        return run

    def torch_hash(cold):
        if cold:
            go_cold(ck)
        return run_measured([sys.executable, script, ck])

    def torch_startup(cold):  # the reference's fixed cost: Python, torch and the DCP loader imported
        return run_measured([sys.executable, "-c", "import warnings, torch, xxhash; warnings.filterwarnings('ignore'); "
                             "import torch.distributed.checkpoint.state_dict_loader"])

    def raw(cold):
        return raw_read_all(ck, cold)

    cases = {
        "raw read (cat DCP)": raw,
        "optstate hash DCP": cli("hash", ck, path=ck, root_of="dcp"),
        "optstate hash native": cli("hash", native, path=native, root_of="native"),
        "optstate hash --values DCP": cli("hash", "--values", ck, path=ck),
        "optstate validate native": cli("validate", native, path=native),
        "torch + xxhash DCP": torch_hash,
        "  of which startup": torch_startup,
    }
    times = {(k, cold): [] for k in cases for cold in (True, False)}
    peaks = {k: 0 for k in cases}
    names = list(cases)
    for rep in range(args.reps + 1):
        # Each round starts at another case: this VM's disk speed drifts, and no case should always
        # run right after the same neighbour.
        order = names[rep % len(names):] + names[:rep % len(names)]
        for cold in (True, False):
            for k in order:
                seconds, peak = cases[k](cold)
                peaks[k] = max(peaks[k], peak)
                if rep:
                    times[(k, cold)].append(seconds)
    assert roots["dcp"] == roots["native"], roots  # one state, one hash, whatever the format

    raw_key = "raw read (cat DCP)"
    ref_key = "torch + xxhash DCP"
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"\n{'case':<28}{'cold s':>8}{'GB/s':>7}{'vs torch':>10}"
          f"{'warm s':>9}{'GB/s':>7}{'% raw':>7}{'vs torch':>10}{'peak RSS':>10}")
    rows = {}
    for k in cases:
        row = {"peak_rss_bytes": peaks[k]}
        line = f"{k:<28}"
        for cold, tag in ((True, "cold"), (False, "warm")):
            m = med[(k, cold)]
            row[tag] = {"median_s": m, "best_s": min(times[(k, cold)]), "gb_per_s": total / m / 1e9,
                        "pct_raw": 100 * med[(raw_key, cold)] / m, "speedup_vs_torch": med[(ref_key, cold)] / m}
            r = row[tag]
            line += f"{m:>{8 if cold else 9}.3f}{r['gb_per_s']:>7.2f}"
            line += f"{r['pct_raw']:>6.0f}%" if not cold else ""
            line += f"{r['speedup_vs_torch']:>9.2f}x"
        line += f"{peaks[k] / 1e6:>8.0f} MB"
        print(line)
        rows[k] = row
    print(f"\nroot hash (DCP and native alike): {roots['dcp']}")
    shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, {"bytes": total, "reps": args.reps, "results": rows})


if __name__ == "__main__":
    main()
