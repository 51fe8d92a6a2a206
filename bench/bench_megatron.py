"""Reading Megatron-LM's torch_dist checkpoint of its distributed optimizer (fully_reshardable) into
plain fp32 per-param state: `optstate convert iter_N plain.safetensors --to fp32` next to torch's own
DCP reader loading the same optimizer items (no Megatron: `dcp.load` of every `optimizer.state.*`
tensor, `no_dist`, then safetensors' `save_file`), side by side in one run on the same checkpoint
and disk, cold page cache, each a fresh process; wall time and peak RSS of each, and the raw copy as
the floor. torch's side reads tensors only: it knows no param groups, steps or Megatron's layout,
which optstate reads besides (`inspect`).

- The checkpoint: Megatron-Core's GPTModel (--layers, --hidden, --vocab; bf16 weights, fp32 main
  params) trained 3 steps on 2 CPU ranks (gloo) with the distributed optimizer and saved as
  Megatron-LM saves it (`tests/data/writers/make_megatron.py`, run `dp2_distopt`).
- Megatron-Core must import: --megatron PATH (a `pip install --target PATH --no-deps
  megatron-core==0.16.1`), used for making the checkpoint only; or 0.13.1, whose distributed
  optimizer saves `fully_sharded_model_space` (N-D flattened items): torch's side then needs
  megatron on its path too (the `.metadata` pickles Megatron's MCoreSavePlan) and puts each item
  back together from `mcore_data`'s shapes.
The two outputs must hold the same fp32 tensors, bit for bit (main params, exp_avg, exp_avg_sq).

--sharding dp_reshardable (the distributed optimizer's default since Megatron-Core 0.14, run
`dp2_distopt_dp_reshardable`): flat per-bucket items whose param layout is not saved; optstate
places each param by value (formats/dcp/megatron_buckets.h). torch alone can only load the flat
buckets (`dcp.load` of every `optimizer.distributed.*` tensor, saved as they are, unplaced): its
side is timed as what reading those bytes costs, and optstate's output is compared bit for bit with
the writer's own reference instead (make_megatron.py gathers it from the live optimizer: each
rank's main params and moments over its range of each param).

--sharding legacy: Megatron-LM's legacy `--ckpt-format torch` checkpoint of the distributed
optimizer (run `legacy_dp2_distopt`: `iter_N/mp_rank_00/model_optim_rng.pt` and
`distrib_optim.pt`, the DDP buffer's main params and moments flat, the param layout not saved);
optstate places each param by value (formats/megatron/FORMAT.md). torch alone can only
`torch.load` the flat buffers: its side is timed as that load and save, unplaced, and optstate's
output compared with the writer's own reference, as for dp_reshardable.

--sharding dp_zero_gather_scatter (Megatron-LM's without --ckpt-fully-parallel-save up to 0.13; run
`dp2_distopt_dp_zero`): each data-parallel group's buffers gathered flat into one ShardedObject,
whose param layout is not saved; optstate walks and places each param by value. torch alone can
only load that object (`dcp.load` of its bytes item, the flat tensors unplaced): timed doing so and
saving them, and optstate's output compared with the writer's own per-param state, as for
dp_reshardable.

--sharding zarr: Megatron-Core's zarr backend (`--ckpt-format zarr`, NeMo 1.x's default; run
`zarr_dp2_distopt` of Megatron-Core 0.9, its distributed optimizer's ranges written into each key's
whole array): --megatron then names megatron-core 0.9.0 with zarr 2 and tensorstore, colon-joined
(make_megatron.py's docstring). The reference reads what Megatron's own zarr load reads: every
`optimizer.state.*` array whole with zarr-python (`zarr.open(...)[...]`, bf16 through tensorstore's
numpy dtype), then safetensors' `save_file`; both outputs equal bit for bit.

    .venv/bin/python bench/bench_megatron.py --megatron /tmp/megatron [--layers 4] [--hidden 1024]
        [--vocab 32768] [--reps 2] [--dir /tmp] [--json bench/results/megatron.json]
"""
import sys
import textwrap
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_dcp_convert import prepare, writer_args, writer_fp32_bench  # noqa: E402

warnings.filterwarnings("ignore")

# torch alone: every optimizer.state.* tensor item of the DCP, loaded by torch's DCP reader in one
# process, saved as <key>.<entry> (Megatron's main params, `param` or 0.13's `fp32_param`, named as
# optstate names the weights: param). On dp_reshardable (a third argument, "buckets"): the flat
# optimizer.distributed.* bucket items, saved as they are (no param layout to place them by).
READ_WITH_TORCH = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from safetensors.torch import save_file
    src, out = sys.argv[1:3]
    if sys.argv[3:] == ["zarr"]:  # every optimizer.state.* zarr array whole, as Megatron's zarr load reads it
        import os
        import zarr
        named = {}
        for name in sorted(os.listdir(src)):
            if (name.startswith("optimizer.state.") and not name.endswith(".sync")  # zarr's lock folders
                    and os.path.isfile(os.path.join(src, name, ".zarray"))):
                entry, key = name[len("optimizer.state."):].split(".", 1)
                entry = "param" if entry == "fp32_param" else entry  # the main params, named as optstate names them
                named[f"{key}.{entry}"] = torch.from_numpy(zarr.open(os.path.join(src, name), "r")[...]).float()
        save_file(named, out)
        sys.exit(0)
    if sys.argv[3:] == ["gathered"]:  # the ShardedObject of the gathered buffers, its flat tensors saved as they are
        import io
        md = dcp.FileSystemReader(src).read_metadata()
        keys = [k for k in md.state_dict_metadata if ".param_state" in k]
        state = {k: io.BytesIO() for k in keys}
        dcp.load(state, checkpoint_id=src, no_dist=True)
        flat = {}
        for k, got in state.items():  # DCP's planner puts the unpickled object in place of the BytesIO
            if isinstance(got, io.BytesIO):
                got.seek(0)
                got = torch.load(got, weights_only=False)
            got = got[0] if isinstance(got, list) else got
            for g, by_dtype in got.items():
                if isinstance(g, int):
                    for d in by_dtype.values():
                        flat.update({f"{k}.{g}.{e}": t for e, t in d.items() if isinstance(t, torch.Tensor)})
        save_file(flat, out)
        sys.exit(0)
    if sys.argv[3:] == ["legacy"]:  # distrib_optim.pt's flat buffers, each saved as it is
        from pathlib import Path
        path, = Path(src).glob("iter_*/mp_rank_00/distrib_optim.pt")
        state = torch.load(path, weights_only=False)
        save_file({f"{b}.{e}": t for b, by_dtype in state.items() if isinstance(b, int)
                   for d in by_dtype.values() for e, t in d.items() if isinstance(t, torch.Tensor)}, out)
        sys.exit(0)
    buckets = sys.argv[3:] == ["buckets"]
    prefix = "optimizer.distributed." if buckets else "optimizer.state."
    md = dcp.FileSystemReader(src).read_metadata()
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=src, no_dist=True)
    if buckets:
        save_file(state, out)
        sys.exit(0)
    nd = getattr(md, "mcore_data", None) or {}
    named = {}
    for k, t in state.items():
        entry, key = k[len(prefix):].split(".", 1)
        shape = nd.get(k, {}).get("nd_reformulated_orig_global_shape")
        if shape is not None:  # [*chunks, chunk numel]: each chunk box back in its place
            cuts, n = t.shape[:-1], len(shape)
            box = [s // c for s, c in zip(shape, cuts)]
            order = [i for d in range(n) for i in (d, n + d)]
            t = t.reshape(*cuts, *box).permute(*order).reshape(shape)
        entry = "param" if entry == "fp32_param" else entry  # 0.13's name of the main params
        named[f"{key}.{entry}"] = t.float().contiguous()
    save_file(named, out)
""")


def main():
    args = writer_args(4, "megatron", "where megatron-core is installed (pip --target)",
                       lambda ap: ap.add_argument("--sharding", choices=["fully_reshardable", "dp_reshardable", "legacy",
                                                                           "zarr", "dp_zero_gather_scatter"],
                                                  default="fully_reshardable",
                                                  help="the distributed optimizer's form (Megatron-Core >= 0.14), or "
                                                       "the legacy --ckpt-format torch"))
    sys.path[:0] = args.megatron.split(":")
    legacy = args.sharding == "legacy"
    zarr = args.sharding == "zarr"
    gathered = args.sharding == "dp_zero_gather_scatter"
    buckets = args.sharding == "dp_reshardable" or legacy or gathered
    cli, work, env, scripts = prepare("megatron", args.dir, "", READ_WITH_TORCH, needs="megatron.core")
    env["PYTHONPATH"] = args.megatron
    run = ("legacy_dp2_distopt" if legacy else "dp2_distopt_dp_zero" if gathered
           else "dp2_distopt_dp_reshardable" if buckets else "zarr_dp2_distopt" if zarr else "dp2_distopt")
    make_env = dict(env, MEGATRON_SIZE=f"{args.layers},{args.hidden},{args.vocab}", MEGATRON_RUNS=run,
                    MEGATRON_REF="1" if buckets else "0")
    make = [sys.executable, str(BENCH.parent / "tests/data/writers/make_megatron.py"), work / "made"]
    writer_fp32_bench(args, cli, work, make_env, scripts, make, work / "made" / run,
                      "Megatron legacy checkpoint (distributed optimizer)" if legacy
                      else "Megatron zarr checkpoint (Megatron-Core 0.9, distributed optimizer)" if zarr
                      else f"Megatron torch_dist checkpoint ({args.sharding})",
                      "torch.load (flat buffers, unplaced)" if legacy
                      else "torch DCP (gathered buffers, unplaced)" if gathered
                      else "torch DCP (flat buckets, unplaced)" if buckets
                      else "zarr-python (every optimizer.state.* array)" if zarr else "torch DCP",
                      "fp32 main params, exp_avg, exp_avg_sq",
                      expected=work / "made" / f"{run}.ref.safetensors" if buckets else None,
                      reference_args=["legacy"] if legacy else ["gathered"] if gathered else ["buckets"] if buckets
                      else ["zarr"] if zarr else [])

if __name__ == "__main__":
    main()
