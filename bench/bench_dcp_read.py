"""Reading a PyTorch DCP checkpoint: optstate (C++, no Python in the read path) vs dcp.load, side by side
in one run on the same checkpoint and the same disk, next to the raw sequential read of its bytes.

The checkpoint: a Llama-shaped model (default ~134M fp32 params) with torch.optim.AdamW state,
saved by get_state_dict + dcp.save (1.6 GB). Both readers fill preallocated tensors of a live model
and optimizer with the same bytes, cold page cache each time (posix_fadvise DONTNEED):
- dcp.load(state_dict of get_state_dict(model, AdamW)) as torch documents for resuming;
- optstate: the torch op behind optstate.load, reading the DCP directory into the same kind of
  tensors in place (ops.load_native_shard with destinations), which parses .metadata with its own
  pickle interpreter and each item's zip, then preads the storages.
And with no model at hand, every tensor allocated by the reader: optstate.read_state_dict (the
(model, optimizer) state dicts get_state_dict gives) vs torch's _load_state_dict_from_keys (the
whole DCP as nested dicts, which dcp_to_torch_save uses).
Median of --reps, round-robin.
--zstd saves the checkpoint through torch's ZStandard extension (FileSystemWriter(_extensions=
[ZStandard()]): each item's archive one zstd stream), which both readers decode: optstate with
libzstd, dcp.load with the zstandard package; "raw read" is then the compressed bytes' read.

    .venv/bin/python bench/bench_dcp_read.py [--layers 8] [--reps 3] [--dir /tmp] [--zstd] [--json bench/results/dcp_read.json]
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import optstate  # noqa: E402
from bench_ckpt import checkpoint_args, drop_cache, make_model, write_json  # noqa: E402

warnings.filterwarnings("ignore")


def stepped(layers):
    model = make_model(layers)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return model, opt


def main():
    ap = checkpoint_args()
    ap.add_argument("--zstd", action="store_true", help="save through torch's ZStandard extension")
    args = ap.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="optstate-bench-dcp-", dir=args.dir))
    ck = work / "dcp"
    model, opt = stepped(args.layers)
    msd, osd = get_state_dict(model, opt)
    if args.zstd:
        from torch.distributed.checkpoint._extension import ZStandard
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(ck), _extensions=[ZStandard()]))
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ck))
    total = sum(os.path.getsize(ck / f) for f in os.listdir(ck))
    print(f"DCP checkpoint{' (zstd)' if args.zstd else ''}: {total / 1e9:.2f} GB in {ck}; {os.cpu_count()} cpus, "
          f"torch {torch.__version__}")

    # Live targets, as a resuming job has them.
    m_t, o_t = stepped(args.layers)
    msd_t, osd_t = get_state_dict(m_t, o_t)
    target = {"model": msd_t, "optim": osd_t}
    m_o, o_o = stepped(args.layers)
    dest = ([], [], [], [])
    for name, p in m_o.named_parameters():
        st = o_o.state[p]
        for entry, comp, t in (("param", "values", p), ("exp_avg", "values", st["exp_avg"]),
                               ("exp_avg_sq", "values", st["exp_avg_sq"])):
            for lst, v in zip(dest, (name, entry, comp, t.detach())):
                lst.append(v)

    data_file = ck / "__0_0.distcp"
    raw = bytearray(os.path.getsize(data_file))

    def t_dcp():
        drop_cache(ck)
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=str(ck))
        return time.perf_counter() - t0

    def t_opt():
        drop_cache(ck)
        t0 = time.perf_counter()
        out = optstate.ops.load_native_shard(str(ck), "", 0, 0, 1, 0, True, *dest)
        dt = time.perf_counter() - t0
        assert {t.data_ptr() for t in out[4]} == {t.data_ptr() for t in dest[3]}  # read in place
        return dt

    def t_raw():
        drop_cache(ck)
        t0 = time.perf_counter()
        with open(data_file, "rb", buffering=0) as f:
            mv = memoryview(raw)
            off = 0
            while off < len(mv):
                n = f.readinto(mv[off:off + (64 << 20)])
                if not n:
                    break
                off += n
        return time.perf_counter() - t0

    # Without a model at hand (analysis, conversion): every tensor allocated by the reader.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    got = {}

    def t_read_sd():
        got.clear()  # the last read's tensors freed first, as for every reader here
        drop_cache(ck)
        t0 = time.perf_counter()
        got["optstate"] = optstate.read_state_dict(ck)
        return time.perf_counter() - t0

    def t_from_keys():
        got.clear()
        drop_cache(ck)
        t0 = time.perf_counter()
        got["torch"] = _load_state_dict_from_keys(checkpoint_id=str(ck))
        return time.perf_counter() - t0

    cases = {"raw read": t_raw, "optstate read": t_opt, "dcp.load": t_dcp, "read_state_dict": t_read_sd,
             "_load_state_dict_from_keys": t_from_keys}
    times = {k: [] for k in cases}
    for rep in range(args.reps + 1):
        for k, f in cases.items():
            t = f()
            if rep:
                times[k].append(t)
    # Both really read the checkpoint's values.
    for (name, p), (_, q) in zip(model.named_parameters(), m_o.named_parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg_sq"], o_o.state[q]["exp_avg_sq"]), name
    assert torch.equal(target["model"][next(iter(target["model"]))], msd[next(iter(msd))])
    weights, optim = optstate.read_state_dict(ck)
    loaded = _load_state_dict_from_keys(checkpoint_id=str(ck))
    for fqn, st in osd["state"].items():
        assert torch.equal(optim["state"][fqn]["exp_avg_sq"], st["exp_avg_sq"]), fqn
        assert torch.equal(loaded["optim"]["state"][fqn]["exp_avg_sq"], st["exp_avg_sq"]), fqn
    assert all(torch.equal(weights[k], v) for k, v in msd.items())
    del weights, optim, loaded

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'case':<28}{'median s':>10}{'best s':>10}{'GB/s':>8}{'% raw':>8}{'vs dcp.load':>13}")
    rows = {}
    for k in cases:
        rows[k] = {"median_s": med[k], "best_s": min(times[k]), "gb_per_s": total / med[k] / 1e9,
                   "pct_raw": 100 * med["raw read"] / med[k], "speedup_vs_dcp_load": med["dcp.load"] / med[k]}
        r = rows[k]
        print(f"{k:<28}{med[k]:>10.3f}{min(times[k]):>10.3f}{r['gb_per_s']:>8.2f}{r['pct_raw']:>7.0f}%"
              f"{r['speedup_vs_dcp_load']:>12.2f}x")
    shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, {"bytes": total, "zstd": args.zstd, "reps": args.reps, "results": rows})


if __name__ == "__main__":
    main()
