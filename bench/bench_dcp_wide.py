"""A DCP of many ranks: its .metadata holds a chunk per rank per tensor (FSDP2's Shard(0) rows of
every weight and moment), hundreds of thousands for a large run, and every chunk is a torch.save
record of its own. `optstate convert SRC x.pt` next to torch's own `dcp_to_torch_save`, side by side
in one run, cold page cache, each a fresh process; wall time and peak RSS of each.

The checkpoint is written rank by rank as that many ranks' DCP save writes it (this machine cannot
run hundreds of ranks): a torchtitan Llama's names (--layers blocks of 7 weights and 2 norms, the
embedding, the final norm and output; every weight [--rows, --cols], norms [--rows]), weights at the
top level, AdamW state flattened under "optimizer", each tensor item cut into --ranks row chunks in
__<rank>_0.distcp, the groups' fields and steps as rank 0 saves them. torch's dcp_to_torch_save
reads it back to the values it was made from (checked here), so it is a DCP as torch reads it.
Both outputs are compared with those values, bit for bit.

    .venv/bin/python bench/bench_dcp_wide.py [--ranks 256] [--layers 32] [--rows 1024] [--cols 64] [--reps 1]
        [--dir /tmp] [--json bench/results/dcp_wide.json]
"""
import io
import os
import pickle
import sys
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_ckpt import checkpoint_args, dir_bytes  # noqa: E402
from bench_dcp_convert import prepare, report, time_cases, time_floor  # noqa: E402

warnings.filterwarnings("ignore")

CONVERT_WITH_TORCH = """
import sys, warnings
warnings.filterwarnings("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""

GROUP = (("lr", 3e-4), ("betas", (0.9, 0.95)), ("eps", 1e-8), ("weight_decay", 0.1), ("amsgrad", False),
         ("maximize", False), ("foreach", None), ("capturable", False), ("differentiable", False), ("fused", None),
         ("decoupled_weight_decay", True), ("initial_lr", 3e-4))


def param_names(layers):
    names = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    for i in range(layers):
        names += [f"layers.{i}.{m}.weight" for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
        names += [f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"]
    return names


def values_of(names, rows, cols):
    g = torch.Generator().manual_seed(0)
    out = {}
    for n in names:
        shape = (rows,) if n.endswith("norm.weight") else (rows, cols)
        out[n] = torch.randn(shape, generator=g)
        out[f"optimizer.state.{n}.exp_avg"] = torch.randn(shape, generator=g)
        out[f"optimizer.state.{n}.exp_avg_sq"] = torch.rand(shape, generator=g)
    return out


def saved(obj):
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def write_wide_dcp(out, ranks, names, values):
    """Every tensor item as `ranks` row chunks, chunk r a torch.save record in __<r>_0.distcp (what
    DCP's FileSystemWriter writes per rank); the .metadata torch's save plan would give."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                        MetadataIndex, TensorProperties, TensorStorageMetadata)
    os.makedirs(out)
    md, storage = {}, {}
    files = [open(os.path.join(out, f"__{r}_0.distcp"), "wb") for r in range(ranks)]

    def put(r, key, offsets, payload):
        at = files[r].tell()
        files[r].write(payload)
        storage[MetadataIndex(key, offsets)] = _StorageInfo(f"__{r}_0.distcp", at, files[r].tell() - at)

    for key, t in values.items():
        per, chunks = t.shape[0] // ranks, []
        for r in range(ranks):
            offsets = torch.Size((r * per,) + (0,) * (t.dim() - 1))
            part = t[r * per:(r + 1) * per].clone()
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=part.shape))
            put(r, key, offsets, saved(part))
        md[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=t.shape, chunks=chunks)
    for n in names:
        key = f"optimizer.state.{n}.step"
        md[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([]),
                                        chunks=[ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))])
        put(0, key, torch.Size([]), saved(torch.tensor(10.0)))
        for field, v in GROUP:
            key = f"optimizer.param_groups.{n}.{field}"
            md[key] = BytesStorageMetadata()
            put(0, key, None, saved(v))
    for f in files:
        f.close()
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=md, planner_data=None, storage_data=storage), f)
    return sum(len(m.chunks) for m in md.values() if isinstance(m, TensorStorageMetadata))


def check_torch(path, values):
    a = torch.load(path)
    for key, t in values.items():
        got = a[key] if key in a else a["optimizer"][key[len("optimizer."):]]
        if not torch.equal(got, t):
            return f"torch: {key} differs"
    return None


def optstate_matches(path, values, entries=("exp_avg", "exp_avg_sq")):
    """optstate's torch.save file ({"model": ..., "optimizer": state_dict}, params named by
    param_names) against a DCP's flat values (weights by fqn, "optimizer.state.<fqn>.<entry>"), bit
    for bit: None, or what differs."""
    a = torch.load(path)
    for k, n in enumerate(a["optimizer"]["param_groups"][0]["param_names"]):
        if not torch.equal(a["model"][n], values[n]):
            return f"optstate: {n}: weights differ"
        for e in entries:
            if not torch.equal(a["optimizer"]["state"][k][e], values[f"optimizer.state.{n}.{e}"]):
                return f"optstate: {n}: {e} differs"
    return None


def against_torch(args, cli, work, env, scripts, src, src_bytes, check, equal):
    """`optstate convert SRC x.pt` and torch's dcp_to_torch_save (scripts["convert_reference.py"]),
    timed side by side; `check(dst)` compares the outputs (None, or what differs), `equal` says what
    agreed; the floor, the table and the JSON."""
    dst = {"optstate": work / "optstate.pt", "torch": work / "torch.pt"}
    cases = {"optstate": lambda d: [cli, "convert", src, d, "--format", "torchsave"],
             "torch": lambda d: [sys.executable, scripts["convert_reference.py"], src, d]}
    times, peak = time_cases(cases, dst, src, args.reps, env)
    diff = check(dst)
    if diff:
        sys.exit(f"outputs differ: {diff}")
    print(equal)
    dst_bytes = os.path.getsize(dst["optstate"])
    time_floor(times, src, work, src_bytes, dst_bytes, args.reps)
    report(args, work, times, peak, src_bytes, dst_bytes, reference="torch")


def main():
    ap = checkpoint_args(layers=32, reps=1)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=64)
    args = ap.parse_args()
    if args.rows % args.ranks:
        sys.exit("--rows must be a multiple of --ranks")
    cli, work, env, scripts = prepare("dcp-wide", args.dir, "", CONVERT_WITH_TORCH, needs="torch")
    src = work / "src"
    names = param_names(args.layers)
    values = values_of(names, args.rows, args.cols)
    chunks = write_wide_dcp(src, args.ranks, names, values)
    src_bytes = dir_bytes(src)
    print(f"SRC: {src_bytes / 1e9:.2f} GB, {len(names)} params on {args.ranks} ranks: {chunks:,} chunks, "
          f".metadata {os.path.getsize(src / '.metadata') / 1e6:.1f} MB; {os.cpu_count()} cpus, torch {torch.__version__}")
    against_torch(args, cli, work, env, scripts, src, src_bytes,
                  lambda dst: check_torch(dst["torch"], values) or optstate_matches(dst["optstate"], values),
                  "outputs equal to the values the checkpoint was made from: weights, exp_avg, exp_avg_sq, bit for bit")


if __name__ == "__main__":
    main()
