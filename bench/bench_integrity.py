"""Checking Megatron-LM's integrity.json (--verify-integrity: each file's SHA-256) with `optstate
validate`, next to Megatron-Core's own check (its `_verify_integrity_manifest_impl`: hashlib's
SHA-256 of each listed file, read in chunks), side by side in one run over the same files, warm
page cache, best of --rounds; and reading the files alone as the floor (GB/s of the listed bytes).

- The checkpoint: the writers corpus' Megatron-Core 0.19 `dp2_distopt_integrity/` (a real
  save with verify_integrity=True), copied, with --gib GiB more of data in --files files listed in
  its integrity.json as Megatron lists its data files (random bytes, digests by hashlib): the
  manifest is what validate spends its time on at that size. validate also reads the checkpoint's
  own 51 entries (a few hundred KiB).
- Ours: SHA-NI where the CPU has it (libckpt/src/sha256.cpp), else the portable rounds; `inspect`
  does not read the manifest, so only validate pays it.

    .venv/bin/python bench/bench_integrity.py [--gib 1] [--files 4] [--rounds 3]
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CK = ROOT / "tests" / "data" / "writers" / "megatron-core-0.19.0_torch-2.13.0" / "dp2_distopt_integrity"
CHUNK = 4 << 20


def megatron_verify(folder):
    """What Megatron-Core's _verify_integrity_manifest_impl does: hashlib over each listed file."""
    manifest = json.loads((folder / "integrity.json").read_text())
    for name, want in manifest["files"].items():
        h = hashlib.sha256()
        with open(folder / name, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                h.update(chunk)
        assert h.hexdigest() == want, name


def read_only(folder):
    manifest = json.loads((folder / "integrity.json").read_text())
    buf = bytearray(CHUNK)
    for name in manifest["files"]:
        with open(folder / name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def best(fn, rounds):
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--optstate", default=str(ROOT / "build" / "optstate"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "iter_0000003"
        shutil.copytree(CK, folder)
        manifest = json.loads((folder / "integrity.json").read_text())
        each = int(args.gib * (1 << 30)) // args.files
        for i in range(args.files):
            name = f"__{i + 2}_0.distcp"  # as further ranks' data files are named
            data = os.urandom(each)
            (folder / name).write_bytes(data)
            manifest["files"][name] = hashlib.sha256(data).hexdigest()
        (folder / "integrity.json").write_text(json.dumps(manifest, indent=2))
        total = sum((folder / n).stat().st_size for n in manifest["files"])

        def ours():
            out = subprocess.run([args.optstate, "validate", str(folder)], capture_output=True, text=True)
            assert out.returncode == 0 and "integrity.json: the SHA-256 of all" in out.stdout, out.stdout + out.stderr

        read_only(folder)  # warm the page cache
        t_read = best(lambda: read_only(folder), args.rounds)
        t_megatron = best(lambda: megatron_verify(folder), args.rounds)
        t_ours = best(ours, args.rounds)
        gb = total / 1e9
        print(f"{len(manifest['files'])} files, {gb:.2f} GB listed in integrity.json, best of {args.rounds}, "
              f"warm page cache")
        print(f"{'':34} {'s':>7} {'GB/s':>7} {'% of read':>10}")
        for label, t in (("read the files (the floor)", t_read),
                         ("Megatron-Core's check (hashlib)", t_megatron),
                         ("optstate validate", t_ours)):
            print(f"{label:34} {t:7.3f} {gb / t:7.2f} {100 * t_read / t:9.0f}%")
        print(f"optstate validate / Megatron's check: {t_ours / t_megatron:.2f}x the time "
              f"(validate also reads the checkpoint's 51 entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
