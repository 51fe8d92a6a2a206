"""Writes the checkpoints Megatron-LM's trainer saves (`--ckpt-format torch_dist`, its default),
for the writers corpus: run it where `megatron.core` imports (megatron-core; no GPU needed: the
CUDA calls Megatron-Core makes are pointed at the CPU by the shim below), e.g.

    pip install --target /tmp/megatron --no-deps megatron-core==0.16.1
    PYTHONPATH=/tmp/megatron python tests/data/writers/make_megatron.py \
        tests/data/writers/megatron-core-0.16.1_torch-2.13.0

Megatron-Core saves `iter_0000003/` through `megatron.core.dist_checkpointing.save`: a DCP whose
items are keyed by the model's sharded keys (the transformer layers stacked along a leading axis,
`decoder.layers.mlp.linear_fc1.weight` of shape [layers, ...], one chunk per layer and
tensor-parallel rank), the optimizer's moments as `optimizer.state.<exp_avg|exp_avg_sq>.<key>`,
beside `common.pt` (torch.save: the param groups, without their members, and the step) and
`metadata.json` (`"sharded_backend": "torch_dist"`), saved as the trainer saves it: beside the
model and optimizer its args, iteration, scheduler and RNG state, the writing shared among the
data-parallel ranks (`--ckpt-fully-parallel-save`). Each run trains Megatron-Core's GPTModel
(the local layer spec: 2 layers, hidden 8) for 3 steps over 2 CPU ranks (gloo) with Megatron's
optimizer (torch's AdamW under it, as without TransformerEngine or apex), weight decay 0.1 on
matrices and none on biases and 1-D params (Megatron's standard groups, `wd_mult` set by its
OptimizerParamScheduler, as the trainer steps it). Written into OUT:

- `tp2/`: tensor parallel 2, Megatron's mixed-precision optimizer (bf16 params, its fp32 copies
  saved as `optimizer.state.fp32_param.<key>`);
- `dp2_distopt/`: data parallel 2, the distributed optimizer (`--use-distributed-optimizer`) with
  bf16 params and fp32 main params, saved `fully_reshardable`
  (`--dist-ckpt-optim-fully-reshardable`): `optimizer.state.param.<key>` the fp32 main params;
- `dp2_distopt_dp_reshardable/`: the distributed optimizer saved `dp_reshardable` (the trainer's
  default for it): flat per-bucket buffers whose param layout the checkpoint does not hold (3
  layers of hidden 16, lr 1e-2: see RUNS_016), its reference read from the live optimizer (each
  rank's main params and moments over its range of each param: `live_rows`; Megatron's own
  `fully_reshardable` gather of the same state misplaced params across several buckets here);
- `tp2_dp2_distopt_dp_reshardable/`: the same under tensor parallel 2 x data parallel 2 (4
  ranks) with DDP buckets of ~1500 elements: each tensor-parallel rank's several buckets, layer
  norms replicated in both;
- `pp2_dp2_distopt_dp_reshardable/`: pipeline parallel 2 (Megatron's schedule over gloo, 4 layers
  of hidden 16, the embedding tied to the last stage's output layer) x data parallel 2, saved
  `dp_reshardable`: each stage's data-parallel group's buckets;
- `pp2_vp2_dp2_distopt_dp_reshardable/`: the same under a virtual pipeline of 2 chunks a stage (the
  interleaved schedule, 2 micro-batches; `model0`/`model1` in the state dict, each chunk's DDP
  buffers its own);
- `tp2_dp2_distopt_dp_zero/`: the same saved `dp_zero_gather_scatter` (Megatron-LM's without
  --ckpt-fully-parallel-save up to 0.13): each data-parallel group's buffers gathered into one
  ShardedObject, as the legacy distrib_optim.pt holds them;
- `moe_ep2_dp_reshardable/`: the mixture of experts saved `dp_reshardable`: a chain of two
  distributed optimizers, each its own data-parallel groups' buckets, prefixed `chained_<i>.`;
- `moe_ep2/`: a mixture of experts (2 experts a layer) under expert parallelism 2, the
  distributed optimizer saved `fully_reshardable`: a chain of two optimizers (the dense params' in
  Megatron's two standard groups, the experts' own), their items unprefixed
  (`chained_optim_avoid_prefix`, as Megatron-LM saves it), the experts stacked along a second axis;
- `moe_ep2_plain/`: the same with Megatron's mixed-precision optimizer, whose chain's items are
  prefixed `chained_0.` and `chained_1.`;
- `dp2_distopt_buckets_misplaced/` (up to 0.16): `dp2_distopt` with DDP buckets of ~300
  elements, which Megatron-Core 0.15 and 0.16 save `fully_reshardable` with its params' state
  misplaced (fixed after 0.16.1); no reference;
- `dp2_distopt_pre_mcore_014/` (0.14 and 0.15 only): `dp2_distopt` saved as Megatron-LM's
  `--dist-ckpt-save-pre-mcore-014` saves it, `fully_sharded_model_space` (below); under 0.15
  (`tests/data/writers/megatron-core-0.15.3_torch-2.13.0`, MEGATRON_RUNS=dp2_distopt,
  dp2_distopt_pre_mcore_014) the `.metadata` is Megatron's own `MCoreMetadata` class;
- `legacy_*` (Megatron-LM's `--ckpt-format torch`, formats/megatron/FORMAT.md): the trainer's
  dict torch.saved per tensor-parallel rank as `iter_0000003/mp_rank_<tp>/model_optim_rng.pt`
  (data-parallel rank 0's), beside `latest_checkpointed_iteration.txt`; the distributed optimizer's
  state in `distrib_optim.pt` beside it (save_parameter_state: each DDP buffer's params, main params
  and moments gathered flat). `legacy_dp2` (bf16, mixed precision), `legacy_fp32_dp2` (fp32, the
  plain optimizer), `legacy_tp2` and `legacy_tp2_swiglu` (tensor parallel 2, SwiGLU's gated MLP),
  `legacy_dp2_distopt` and `legacy_tp2_dp2_distopt` (the distributed optimizer; 3 layers of hidden
  16, the second with DDP buckets of ~1500 elements), `legacy_pp2` (pipeline parallel 2 through
  Megatron's pipeline schedule over gloo, the embedding tied to the output layer) and
  `legacy_tp2_pp2_dp2_distopt` (8 ranks, stages of 1 and 2 layers, untied), `legacy_pp2_vp2` and
  `legacy_pp2_vp2_dp2_distopt` (a virtual pipeline of 2 chunks a stage: model0, model1 in each
  stage's file), and mixtures of
  experts (2 a layer): `legacy_moe_dp2` (no expert parallelism: the experts in the dense
  optimizer), `legacy_moe_ep2` (expert parallel 2: folders mp_rank_00_<ep>, Megatron's chain of
  the dense params' and the experts' optimizers), `legacy_moe_pp2_ep2` (mp_rank_00_<pp>_<ep>), `legacy_moe_pp2_vp2_ep2` (the same under a
  virtual pipeline of 2 chunks a stage),
  `legacy_moe_ep2_distopt` and
  `legacy_moe_tp2_ep2_dp2_distopt` (8 ranks; sequence parallelism, which MoE under tensor
  parallelism requires, with the torch norms marked as apex's: torch_norm_under_sequence_parallel);
  their references
  named as the state_dict names the params (a layer each, numbered over the whole model);
Under Megatron-Core 0.19 (not on this machine's PyPI: its release tag's source, `git -C Megatron-LM
archive core_v0.19.0 megatron/core | tar -x -C /tmp/mcore19`, with triton installed beside it,
`pip install --target /tmp/mc19deps --no-deps triton`, which it imports; PYTHONPATH=/tmp/mcore19:
/tmp/mc19deps, MEGATRON_RUNS=tp2,dp2_distopt,dp2_distopt_dp_reshardable,moe_ep2,dp2_distopt_dp_zero,
dp2_distopt_integrity,
OUT `tests/data/writers/megatron-core-0.19.0_torch-2.13.0`) the same runs save no common.pt: the
common state is the DCP's own `common_state/shard_0_1` item (torch.save([dict])); and
`dp2_distopt_integrity/` is `dp2_distopt` saved as Megatron-LM's --verify-integrity saves it, with
`integrity.json` beside (each file's SHA-256).

Under Megatron-Core 0.13.1 (`pip install --target /tmp/mc013 --no-deps megatron-core==0.13.1`,
OUT `tests/data/writers/megatron-core-0.13.1_torch-2.13.0`) the runs are its distributed optimizer
saved `fully_sharded_model_space`, its default (N-D flattened items, `mcore_data` in `.metadata`):

- `dp2_distopt/`: data parallel 2, bf16, 3 layers of hidden 16 (the ranks' halves of the buffer
  split a layer's `linear_fc1.weight`);
- `tp2_dp2_distopt/`: tensor parallel 2 x data parallel 2 (4 ranks), bf16;
- `moe_ep2/`: the mixture of experts under expert parallelism 2, its chain's items prefixed
  `chained_<i>.` (0.13 has no chained_optim_avoid_prefix);
- `tp2_dp2_distopt_optim_only/`: `tp2_dp2_distopt` without the model's items, as verl's Megatron
  backend saves its `optimizer/dist_ckpt/` (the main params the only weights);

Under Megatron-Core 0.9.0 with zarr 2 and tensorstore (`pip install --target /tmp/mc09 --no-deps
megatron-core==0.9.0 zarr==2.18.7 numcodecs==0.15.2 asciitree fasteners tensorstore ml_dtypes`,
OUT `tests/data/writers/megatron-core-0.9.0_torch-2.13.0`) the runs are saved with its zarr backend
(`--ckpt-format zarr`, NeMo 1.x's default `dist_ckpt_format`), its optimizers over ApexFusedAdam
(0.9's distributed optimizer requires apex's or TransformerEngine's FusedAdam; the step then in each
param group): `zarr_tp2`, `zarr_fp32_dp2` (fp32, the plain optimizer), `zarr_dp2_distopt` (3
layers of hidden 16) and `zarr_tp2_dp2_distopt` (the distributed optimizer saved
`fully_sharded_model_space`: its ranges written into each key's whole array), `zarr_moe_ep2`,
NeMo 1.x's checkpoint dict (nemo1_checkpoint) of `nemo1_zarr_tp2` and `nemo1_zarr_tp2_dp2_distopt`,
and `zarr_dp2_distopt_dp_zero`, `zarr_tp2_dp2_distopt_dp_zero` (saved `dp_zero_gather_scatter`, lr
1e-2, the latter with DDP buckets of ~1500 elements).

- `<run>.ref.safetensors`: what the optimizer held, per sharded key (`<key>.param`: the fp32 main
  param, or the fp32 weight; `<key>.exp_avg`, `<key>.exp_avg_sq`), gathered from every rank's
  shards before the save, with each key's step and group settings as
  `tests/data/torch_versions/make.py` records them.
"""
import argparse
import contextlib
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch_versions"))
from make import enter_cpu_mode, save_ref, spawn_ranks  # noqa: E402

# bench/bench_megatron.py's larger model: MEGATRON_SIZE="layers,hidden,vocab", MEGATRON_RUNS a
# comma-separated subset of RUNS, MEGATRON_REF=0 (no .ref.safetensors: nothing gathered).
SIZE = os.environ.get("MEGATRON_SIZE")  # else each run's own ("size", default 2 layers, hidden 8, vocab 16)
RUNS_016 = {
    "tp2": dict(tp=2, dist_opt=False, bf16=True, sharding=None),
    "dp2_distopt": dict(tp=1, dist_opt=True, bf16=True, sharding="fully_reshardable"),
    # dp_reshardable (the default): lr 1e-2, so that the layer norms' weights leave their initial
    # 1.0 in bf16 within the 3 steps, as in any checkpoint past its first steps (params of equal
    # values under different keys cannot be placed: megatron_buckets.h); 3 layers of hidden 16 so
    # that the data-parallel ranks' halves of a bucket split a param.
    "dp2_distopt_dp_reshardable": dict(tp=1, dist_opt=True, bf16=True, sharding="dp_reshardable", lr=1e-2,
                                       size="3,16,16"),
    # ... and under tensor parallel 2 with DDP buckets of ~1500 elements: several a rank
    "tp2_dp2_distopt_dp_reshardable": dict(tp=2, dist_opt=True, bf16=True, sharding="dp_reshardable", lr=1e-2,
                                           size="3,16,16", world=4, bucket_size=1500),
    "moe_ep2_dp_reshardable": dict(tp=1, ep=2, dist_opt=True, bf16=True, sharding="dp_reshardable", lr=1e-2),
    # dp_zero_gather_scatter (deprecated, still saved): each data-parallel group's buffers gathered flat
    # into one ShardedObject, as Megatron-LM's legacy distrib_optim.pt; its param groups in another
    "dp2_distopt_dp_zero": dict(tp=1, dist_opt=True, bf16=True, sharding="dp_zero_gather_scatter", lr=1e-2,
                                size="3,16,16"),  # also bench_megatron.py --sharding dp_zero_gather_scatter
    "tp2_dp2_distopt_dp_zero": dict(tp=2, dist_opt=True, bf16=True, sharding="dp_zero_gather_scatter", lr=1e-2,
                                    size="3,16,16", world=4, bucket_size=1500),
    # fully_reshardable with several DDP buckets: Megatron-Core 0.15 and 0.16 save it misplaced (its
    # gather strips the padding between buckets, then slices params at their padded offsets); no
    # reference: optstate refuses it, the main params not rounding to the weights beside
    "dp2_distopt_buckets_misplaced": dict(tp=1, dist_opt=True, bf16=True, sharding="fully_reshardable",
                                          bucket_size=300, ref=False, upto=(0, 16)),
    "moe_ep2": dict(tp=1, ep=2, dist_opt=True, bf16=True, sharding="fully_reshardable"),
    "moe_ep2_plain": dict(tp=1, ep=2, dist_opt=False, bf16=True, sharding=None),
    # Megatron-LM 0.14-0.15 with --dist-ckpt-save-pre-mcore-014 (or torch < 2.6): the form up to
    # 0.13 (N-D flattened items; 0.15's .metadata Megatron's own MCoreMetadata). 0.16 refuses it.
    "dp2_distopt_pre_mcore_014": dict(tp=1, dist_opt=True, bf16=True, sharding="fully_sharded_model_space",
                                      upto=(0, 15)),
    # pipeline parallel 2 (Megatron's schedule over gloo; the embedding tied to the last stage's output
    # layer) x data parallel 2, the distributed optimizer saved dp_reshardable (the trainer's default):
    # each stage's buckets its own data-parallel group's items
    "pp2_dp2_distopt_dp_reshardable": dict(tp=1, pp=2, dist_opt=True, bf16=True, sharding="dp_reshardable",
                                           lr=1e-2, size="4,16,16", world=4, tied=True),
    # ... under a virtual pipeline of 2 chunks a stage (--num-layers-per-virtual-pipeline-stage 1: the
    # interleaved schedule; model0/model1 in the state dict, each chunk's buffers its own)
    "pp2_vp2_dp2_distopt_dp_reshardable": dict(tp=1, pp=2, vp=2, dist_opt=True, bf16=True,
                                               sharding="dp_reshardable", lr=1e-2, size="4,16,16", world=4,
                                               tied=True),
    # Megatron-LM's legacy `--ckpt-format torch`: iter_N/mp_rank_<tp>/model_optim_rng.pt per
    # model-parallel rank (torch.save of the trainer's dict: the model's state_dict, the optimizer's
    # own state_dict), the distributed optimizer's state beside it in distrib_optim.pt (its
    # data-parallel rank 0 gathers each DDP buffer's flat param and moments)
    "legacy_tp2": dict(tp=2, dist_opt=False, bf16=True, sharding=None, legacy=True),
    "legacy_dp2": dict(tp=1, dist_opt=False, bf16=True, sharding=None, legacy=True),
    # pipeline parallel 2 (mp_rank_00_000, mp_rank_00_001: each stage's layers numbered from 0), the
    # embedding tied to the output layer (the last stage's copy of it, output_layer.weight)
    "legacy_pp2": dict(tp=1, pp=2, dist_opt=False, bf16=True, sharding=None, legacy=True, tied=True, size="4,8,16"),
    # ... and tensor parallel 2 x pipeline parallel 2 x data parallel 2 with the distributed optimizer,
    # the embedding and output layer untied, the first stage holding 1 layer of 3
    "legacy_tp2_pp2_dp2_distopt": dict(tp=2, pp=2, dist_opt=True, bf16=True, sharding=None, legacy=True, lr=1e-2,
                                       size="3,16,16", world=8, first_stage_layers=1),
    # SwiGLU (--swiglu): each tensor-parallel rank's linear_fc1 its part of the gate above its part of up
    # ... under a virtual pipeline of 2 chunks a stage (model0, model1 in each stage's file)
    "legacy_pp2_vp2": dict(tp=1, pp=2, vp=2, dist_opt=False, bf16=True, sharding=None, legacy=True, tied=True,
                           size="4,8,16"),
    "legacy_pp2_vp2_dp2_distopt": dict(tp=1, pp=2, vp=2, dist_opt=True, bf16=True, sharding=None, legacy=True,
                                       lr=1e-2, size="4,16,16", world=4, tied=True),
    "legacy_tp2_swiglu": dict(tp=2, dist_opt=False, bf16=True, sharding=None, legacy=True, glu=True),
    "legacy_fp32_dp2": dict(tp=1, dist_opt=False, bf16=False, sharding=None, legacy=True),
    "legacy_dp2_distopt": dict(tp=1, dist_opt=True, bf16=True, sharding=None, legacy=True, lr=1e-2,
                               size="3,16,16"),
    "legacy_tp2_dp2_distopt": dict(tp=2, dist_opt=True, bf16=True, sharding=None, legacy=True, lr=1e-2,
                                   size="3,16,16", world=4, bucket_size=1500),
    # a mixture of experts (2 a layer): its experts' params an optimizer of their own (Megatron's
    # chain: the optimizer's state_dict a list of two); under expert parallelism 2 each expert rank's
    # folder mp_rank_<tp>_<ep> holds its experts (numbered locally) and the dense params
    "legacy_moe_dp2": dict(tp=1, moe=True, dist_opt=False, bf16=True, sharding=None, legacy=True),
    "legacy_moe_ep2": dict(tp=1, ep=2, dist_opt=False, bf16=True, sharding=None, legacy=True),
    "legacy_moe_ep2_distopt": dict(tp=1, ep=2, dist_opt=True, bf16=True, sharding=None, legacy=True, lr=1e-2,
                                   size="3,16,16"),
    # ... and over pipeline stages (folders mp_rank_00_<pp>_<ep>)
    "legacy_moe_pp2_ep2": dict(tp=1, pp=2, ep=2, dist_opt=False, bf16=True, sharding=None, legacy=True,
                               size="4,8,16", world=4),
    "legacy_moe_pp2_vp2_ep2": dict(tp=1, pp=2, vp=2, ep=2, dist_opt=False, bf16=True, sharding=None, legacy=True,
                                   size="4,8,16", world=4),
    "legacy_moe_tp2_ep2_dp2_distopt": dict(tp=2, ep=2, dist_opt=True, bf16=True, sharding=None, legacy=True,
                                           lr=1e-2, size="3,16,16", world=8),
}
# Megatron-Core up to 0.13 saves the distributed optimizer `fully_sharded_model_space` (its default,
# and Megatron-LM's with --ckpt-fully-parallel-save, NeMo's with parallel_save_optim): per key, each
# data-parallel rank's flattened range of its tensor-parallel chunk, in an item reshaped to
# [*chunks, chunk numel] (`nd_reformulated_orig_global_shape` in .metadata's mcore_data). 3 layers of
# hidden 16: the data-parallel ranks' halves of the buffer split a param (a layer's linear_fc2).
RUNS_013 = {
    "dp2_distopt": dict(tp=1, dist_opt=True, bf16=True, sharding="fully_sharded_model_space", size="3,16,16"),
    "tp2_dp2_distopt": dict(tp=2, dist_opt=True, bf16=True, sharding="fully_sharded_model_space", world=4),
    "moe_ep2": dict(tp=1, ep=2, dist_opt=True, bf16=True, sharding="fully_sharded_model_space"),
    "tp2_dp2_distopt_optim_only": dict(tp=2, dist_opt=True, bf16=True, sharding="fully_sharded_model_space",
                                       world=4, model=False),
}


# Megatron-Core 0.9 (the zarr backend's last releases: NeMo 1.x saved with it, `dist_ckpt_format:
# zarr`, before torch_dist became its default) with zarr 2 and tensorstore (numpy's bfloat16):
# `--ckpt-format zarr`, each sharded key a zarr array of its whole tensor. Its distributed optimizer
# saved fully_sharded_model_space, as with --ckpt-fully-parallel-save.
RUNS_09 = {
    "zarr_tp2": dict(tp=2, dist_opt=False, bf16=True, sharding=None, backend="zarr"),
    "zarr_fp32_dp2": dict(tp=1, dist_opt=False, bf16=False, sharding=None, backend="zarr"),
    "zarr_dp2_distopt": dict(tp=1, dist_opt=True, bf16=True, sharding="fully_sharded_model_space", size="3,16,16",
                             backend="zarr"),
    "zarr_tp2_dp2_distopt": dict(tp=2, dist_opt=True, bf16=True, sharding="fully_sharded_model_space", world=4,
                                 backend="zarr"),
    "zarr_moe_ep2": dict(tp=1, ep=2, dist_opt=True, bf16=True, sharding="fully_sharded_model_space",
                         backend="zarr"),
    # the distributed optimizer saved dp_zero_gather_scatter (Megatron-LM's without
    # --ckpt-fully-parallel-save, NeMo 1.x's without dist_ckpt_parallel_save): each data-parallel
    # group's buffers gathered flat into one ShardedObject; lr 1e-2 so the layer norms leave 1.0 in
    # bf16 (the params are placed by value), DDP buckets of ~1500 elements under tensor parallelism
    "zarr_dp2_distopt_dp_zero": dict(tp=1, dist_opt=True, bf16=True, sharding="dp_zero_gather_scatter",
                                     size="3,16,16", lr=1e-2, backend="zarr"),
    "zarr_tp2_dp2_distopt_dp_zero": dict(tp=2, dist_opt=True, bf16=True, sharding="dp_zero_gather_scatter",
                                         size="3,16,16", lr=1e-2, world=4, bucket_size=1500, backend="zarr"),
    # NeMo 1.x's checkpoint of its GPT model (nemo1_checkpoint; 0.9's torch_dist strategy does not run on torch 2.13)
    "nemo1_zarr_tp2_dp2_distopt": dict(tp=2, dist_opt=True, bf16=True, sharding="fully_sharded_model_space",
                                       world=4, backend="zarr", nemo1=True),
    "nemo1_zarr_tp2": dict(tp=2, dist_opt=False, bf16=True, sharding=None, backend="zarr", nemo1=True),
}


def mcore_version():
    from megatron.core import package_info
    return tuple(int(x) for x in package_info.__version__.split(".")[:2])


# Megatron-Core 0.19 on: Megatron-LM's --verify-integrity, the save's integrity.json (each file's SHA-256)
RUNS_019 = dict(RUNS_016, dp2_distopt_integrity=dict(RUNS_016["dp2_distopt"], integrity=True))


def runs():
    v = mcore_version()
    return RUNS_09 if v < (0, 10) else RUNS_013 if v < (0, 14) else RUNS_016 if v < (0, 19) else RUNS_019


def torch_norm_under_sequence_parallel():
    """Megatron-Core's torch LayerNorm (the local spec's, without apex or TransformerEngine) refuses
    sequence parallelism, which a mixture of experts under tensor parallelism requires; the norm
    itself is the same either way: built as without it, its params marked `sequence_parallel` as
    apex's are, so that finalize_model_grads sums their gradients over the tensor-parallel ranks."""
    from megatron.core.transformer import torch_norm

    made = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = made(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def cpu_shim():
    """Megatron-Core places its buffers on torch.cuda.current_device() and some tensors on
    device='cuda', and checks params' type() for torch.cuda.*Tensor: all of it on the CPU here."""
    torch.cuda.is_available = lambda: False
    enter_cpu_mode(cuda_types=True)

    class CpuStream:  # 0.19's grad sync waits on the current stream for CUDA-graph replays' events
        def __getattr__(self, name):
            return lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: CpuStream()
    from megatron.core.tensor_parallel import random as mrandom
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    moe_utils.te_general_gemm = None  # referenced unguarded without TransformerEngine
    if mcore_version() < (0, 10):
        apex_fused_adam()
        # 0.9's router and dispatchers count tokens per expert with torch.histc over the expert
        # indices, which CUDA takes as integers and the CPU only as floats: counted as floats there
        histc = torch.histc
        torch.histc = lambda t, *a, **k: (histc(t.float(), *a, **k).to(t.dtype) if not t.is_floating_point()
                                          else histc(t, *a, **k))
    import numpy
    if not hasattr(numpy, "product"):  # Megatron-Core 0.13's validation calls it; numpy 2 dropped it
        numpy.product = numpy.prod


class ApexFusedAdam(torch.optim.Optimizer):
    """apex.optimizers.FusedAdam as Megatron-Core 0.9 builds it (adam_w_mode, bias correction) on the
    CPU: each param group's `step` counted in the group, the state exp_avg and exp_avg_sq alone, and
    apex's update (multi_tensor_adam, ADAM_MODE_1): p -= lr * (m/bc1 / (sqrt(v/bc2) + eps) + wd * p).
    0.9's distributed optimizer is built only over apex's or TransformerEngine's FusedAdam (which
    NeMo 1.x and Megatron-LM ran with), neither of which runs here."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        assert adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            (b1, b2), t = group["betas"], group["step"]
            bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"]) + group["weight_decay"] * p
                p.sub_(group["lr"] * update)


def apex_fused_adam():
    """Megatron-Core 0.9's optimizers over ApexFusedAdam, as where apex is installed."""
    import megatron.core.optimizer as mo
    from megatron.core.optimizer import distrib_optimizer as do
    mo.Adam = do.Adam = ApexFusedAdam
    do.HAVE_APEX_OR_TE = True


def sharded_rows(sharded):
    """This rank's part of each sharded key, from its ShardedTensors (the first replica of each
    shard): (key, global shape, global offset, box, flat start or None, fp32 values) for gathered()."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rows = []
    for st in sharded:
        if not isinstance(st, ShardedTensor):
            continue
        replica = st.replica_id if isinstance(st.replica_id, tuple) else (st.replica_id,)
        if any(replica):
            continue
        # a stacked layer's shard: its layer's axis (prepended) of length 1; the distributed
        # optimizer's fully_sharded_model_space state: a flat range of that box (flattened_range)
        box = (1,) * st.prepend_axis_num + tuple(st.local_shape)
        flat = st.flattened_range
        local = st.data.detach().float().clone()  # its own storage: a view would pickle its whole buffer
        rows.append((st.key, tuple(st.global_shape), tuple(st.global_offset), box,
                     None if flat is None else flat.start, local if flat is not None else local.reshape(box)))
    return rows


def main_param_and_states(inner, model_param):
    """The distributed optimizer's fp32 main param of `model_param` (this rank's range) and its
    moments (Megatron-Core 0.9 has no _get_main_param_and_optimizer_states: as that does)."""
    if hasattr(inner, "_get_main_param_and_optimizer_states"):
        return inner._get_main_param_and_optimizer_states(model_param)
    group_index, group_order = inner.model_param_group_index_map[model_param]
    main = inner.optimizer.param_groups[group_index]["params"][group_order]
    return {"param": main, **inner.optimizer.state[main]}


def live_rows(module, opt):
    """The distributed optimizer's state as it holds it: for each param this rank steps, its range
    of the param (this rank's share of the buffer) with the main params and moments over it, keyed
    `optimizer.state.<entry>.<key>` as the per-param forms save them; a param replicated over
    tensor-parallel ranks from the first of them (its ShardedTensor's replica id, the data-parallel
    part left out)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rows = []
    for st in module.sharded_state_dict().values():
        if not isinstance(st, ShardedTensor) or st.data is None:
            continue
        replica = st.replica_id if isinstance(st.replica_id, tuple) else (st.replica_id,)
        if any(replica[:-1]):
            continue
        for inner in getattr(opt, "chained_optimizers", [opt]):
            if st.data not in inner.model_param_gbuf_map:
                continue
            part = inner._get_model_param_range_map(st.data)["param"]
            box = (1,) * st.prepend_axis_num + tuple(st.local_shape)
            for entry, t in main_param_and_states(inner, st.data).items():
                if entry != "step":
                    rows.append((f"optimizer.state.{entry}.{st.key}", tuple(st.global_shape), tuple(st.global_offset),
                                 box, part.start, t.detach().float().clone()))
    return rows


def gathered(mine, rank):
    """Each key's whole tensor (fp32, on rank 0; None on the others), from every rank's rows
    (sharded_rows, live_rows)."""
    import torch.distributed as dist

    pieces = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, pieces, dst=0)  # on rank 0 only: a large model's state once
    if rank != 0:
        return None
    whole, boxes = {}, {}
    for part in pieces:
        for key, shape, offset, box, start, local in part:
            whole.setdefault(key, torch.full(shape, float("nan")))
            b = boxes.setdefault((key, offset), torch.full(box, float("nan")))
            if start is None:
                b.copy_(local)
            else:
                b.view(-1)[start:start + local.numel()] = local
    for (key, offset), b in boxes.items():
        whole[key][tuple(slice(o, o + n) for o, n in zip(offset, b.shape))] = b
    for key, t in whole.items():
        assert not t.isnan().any(), key
    return whole


def rank_main(rank, world, port, out):
    cpu_shim()
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    chosen = os.environ.get("MEGATRON_RUNS")
    for name, run in runs().items():
        if (chosen and name not in chosen.split(",")) or run.get("world", 2) != world:
            continue
        if mcore_version() > run.get("upto", mcore_version()):
            continue
        ep = run.get("ep", 1)
        moe = run.get("moe", ep > 1)
        LAYERS, HIDDEN, VOCAB = map(int, (SIZE or run.get("size", "2,8,16")).split(","))
        pp, vp = run.get("pp", 1), run.get("vp")
        parallel_state.initialize_model_parallel(run["tp"], pp, virtual_pipeline_model_parallel_size=vp,
                                                 expert_model_parallel_size=ep)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if run["bf16"] else torch.float32
        cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                                hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=run["tp"],
                                bf16=run["bf16"], params_dtype=dtype, pipeline_dtype=dtype,
                                **(dict(num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True,
                                        moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep,
                                        add_bias_linear=False) if moe else {}),
                                # Megatron requires sequence parallelism for MoE under tensor parallelism
                                **(dict(sequence_parallel=True) if moe and run["tp"] > 1 else {}),
                                **(dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
                                   if run.get("glu") else {}),
                                **(dict(pipeline_model_parallel_size=pp) if pp > 1 else {}),
                                **(dict(virtual_pipeline_model_parallel_size=vp) if vp else {}),
                                **(dict(num_layers_in_first_pipeline_stage=run["first_stage_layers"])
                                   if "first_stage_layers" in run else {}))
        if moe and run["tp"] > 1:
            torch_norm_under_sequence_parallel()
        spec = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False) if moe else get_gpt_layer_local_spec()
        # the model, or under a virtual pipeline each of its chunks (Megatron-LM's get_model: chunk i
        # holds this stage's i-th share of the layers, each chunk a DDP of its own, bucketed the first only)
        ddps = []
        for vp_stage in range(vp) if vp else [None]:
            stage = dict(ignore_virtual=not vp, **(dict(vp_stage=vp_stage) if vp else {}))
            model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=4,
                             pre_process=parallel_state.is_pipeline_first_stage(**stage),
                             post_process=parallel_state.is_pipeline_last_stage(**stage),
                             share_embeddings_and_output_weights=run.get("tied", False),
                             **(dict(vp_stage=vp_stage) if vp else {}))
            if run["bf16"]:  # as Megatron-LM's get_model wraps it
                from megatron.core.transformer.module import Float16Module
                model = Float16Module(cfg, model)
            ddps.append(DistributedDataParallel(
                config=cfg, module=model, disable_bucketing=bool(vp_stage), ddp_config=DistributedDataParallelConfig(
                    use_distributed_optimizer=run["dist_opt"], grad_reduce_in_fp32=True,
                    bucket_size=run.get("bucket_size"),
                    overlap_grad_reduce="bucket_size" in run)))  # Megatron makes buckets only to overlap their reduction
        ddp = ddps[0]
        lr = run.get("lr", 1e-3)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.1,
                                                     adam_beta2=0.95, bf16=run["bf16"],
                                                     use_distributed_optimizer=run["dist_opt"]), ddps)
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=10, wd_incr_style="constant")
        gen = torch.Generator().manual_seed(1 + parallel_state.get_data_parallel_rank())
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (2, 4), generator=gen)
            pos = torch.arange(4).unsqueeze(0).expand(2, 4)
            mask = torch.tril(torch.ones(4, 4, dtype=torch.bool)).logical_not().view(1, 1, 4, 4)
            for d in ddps:
                d.zero_grad_buffer()
            opt.zero_grad()
            if pp > 1:  # Megatron's pipeline schedule: activations sent between the stages (gloo)
                pipeline_step(cfg, ddps, ids, pos, mask)
                ok, _, _ = opt.step()
                assert ok
                sched.step(1)
                continue
            ddp(ids, pos, mask, labels=ids).float().mean().backward()
            if cfg.sequence_parallel:  # as the trainer: the layer norms' gradients summed over the tp ranks too
                from megatron.core.distributed import finalize_model_grads
                finalize_model_grads([ddp])
            else:
                ddp.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok
            sched.step(1)
        if run.get("legacy"):
            save_legacy(name, run, out, ddps, opt, sched, rank, LAYERS, HIDDEN)
            parallel_state.destroy_model_parallel()
            continue
        # Megatron-LM's sharded-state-dict metadata (_build_sharded_state_dict_metadata, Megatron-Core
        # >= 0.14): dp_reshardable unless --dist-ckpt-optim-fully-reshardable; a chain of optimizers'
        # items unprefixed only where the distributed optimizer saves fully_reshardable
        metadata = {"distrib_optim_sharding_type": run["sharding"] or "dp_reshardable",
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if mcore_version() < (0, 14):  # Megatron-LM then passed the sharding type alone
            metadata = {"distrib_optim_sharding_type": run["sharding"] or "fully_sharded_model_space"}
        # What Megatron-LM's trainer saves (training/checkpointing.py, generate_state_dict)
        state = {"args": argparse.Namespace(tensor_model_parallel_size=run["tp"], num_layers=LAYERS, hidden_size=HIDDEN,
                                            lr=1e-3, weight_decay=0.1, bf16=run["bf16"], params_dtype=dtype),
                 "checkpoint_version": 3.0, "iteration": 3}
        prefix = "model." if run.get("nemo1") else ""  # NeMo's GPT model: its module's keys under model.
        models = {("model" if len(ddps) == 1 else f"model{i}"): d.module.sharded_state_dict(prefix=prefix,
                                                                                             metadata=metadata)
                  for i, d in enumerate(ddps)}
        state.update(models)
        if run.get("nemo1"):
            state = nemo1_checkpoint(run, models["model"], opt, sched, LAYERS, HIDDEN)
        elif mcore_version() < (0, 10):  # the sharding type its own argument, the distributed optimizer's alone
            state["optimizer"] = opt.sharded_state_dict(
                state, **(dict(sharding_type=run["sharding"]) if run["dist_opt"] else {}))
        else:
            state["optimizer"] = opt.sharded_state_dict(state, metadata=metadata)
        if not run.get("model", True):  # verl's optimizer/dist_ckpt/: no model weights beside
            for key in models:
                del state[key]
        if not run.get("nemo1"):
            state["opt_param_scheduler"] = sched.state_dict()
            state["num_floating_point_operations_so_far"] = 0
            state["rng_state"] = ShardedObject(
                "rng_state", [{"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}],
                (pp, run["tp"]), (parallel_state.get_pipeline_model_parallel_rank(),
                                  parallel_state.get_tensor_model_parallel_rank()),
                replica_id=parallel_state.get_data_parallel_rank())
        apply_factories(state)
        refd = os.environ.get("MEGATRON_REF", "1") != "0" and run.get("ref", True)
        rows = sharded_rows(nested_values(state)) if refd else None
        if refd and run["sharding"] in ("dp_reshardable", "dp_zero_gather_scatter"):  # from the optimizer itself
            rows = sharded_rows(nested_values(models)) + [r for d in ddps for r in live_rows(d.module, opt)]
        whole = gathered(rows, rank) if refd else None
        settings = {}
        for part in all_ranks({k: v for d in ddps for k, v in key_settings(d.module, opt, prefix).items()}):
            for key, v in part.items():
                assert settings.setdefault(key, v) == v, key
        path = os.path.join(out, name)
        if rank == 0 and os.path.isdir(path):
            import shutil
            shutil.rmtree(path)
        if rank == 0:
            os.makedirs(path)  # Megatron-LM's trainer makes iter_N/ before the save
        dist.barrier()
        # --ckpt-fully-parallel-save (Megatron-LM's default): the data-parallel ranks share the writing
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(run.get("backend", "torch_dist")),
                                                    parallel_state.get_data_parallel_group(with_context_parallel=True),
                                                    True)
        if mcore_version() < (0, 10):
            dist_checkpointing.save(state, path, strategy)
        else:
            extra = dict(verify_integrity=True) if run.get("integrity") else {}
            dist_checkpointing.save(state, path, strategy, content_metadata=metadata, **extra)
        if rank == 0 and refd:
            write_ref(path, whole, settings)
        dist.barrier()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def nemo1_checkpoint(run, model_sd, opt, sched, layers, hidden):
    """What NeMo 1.x's NLPDDPStrategy saves through dist_checkpointing (its `save_checkpoint` with
    distributed checkpointing): Lightning's checkpoint dict, the model's sharded state dict under
    `sharded_state_dict` (MegatronGPTModel.on_save_checkpoint; its keys prefixed `model.`), the
    optimizer's as a list under `optimizer_states` (optimizer_sharded_state_dict: built over the
    model's without `_extra_state`; mcore's distributed optimizer `fully_sharded_model_space` as
    with `dist_ckpt_parallel_save`), `state_dict` emptied, beside Lightning's own keys."""
    without_extra = {k: v for k, v in model_sd.items() if not k.endswith("_extra_state")}
    optim = opt.sharded_state_dict(without_extra, **(dict(sharding_type=run["sharding"]) if run["dist_opt"] else {}))
    return {"epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.4.0", "state_dict": {},
            "sharded_state_dict": model_sd, "optimizer_states": [optim],
            "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 0}}}}, "callbacks": {},
            "lr_schedulers": [sched.state_dict()], "hparams_name": "cfg",
            "hyper_parameters": {"cfg": {"tensor_model_parallel_size": run["tp"], "num_layers": layers,
                                         "hidden_size": hidden, "mcore_gpt": True}}}


def pipeline_step(cfg, ddps, ids, pos, mask):
    """One step's forward and backward through Megatron's pipeline schedule (one micro-batch; under a
    virtual pipeline the interleaved schedule over the model's chunks, a micro-batch per stage), the
    gradients then finished as Megatron-LM's trainer does (finalize_model_grads: data-parallel
    reduction, the tied embedding's gradients summed over its first and last stages' copies)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = [d.no_sync for d in ddps] if len(ddps) > 1 else ddps[0].no_sync
    cfg.grad_sync_func = None

    def forward_step(data, model):
        out = model(*next(data), labels=ids)

        def loss_func(output):
            loss = output.float().sum()
            return loss, torch.tensor(output.numel()), {"loss": loss.detach()}
        return out, loss_func

    from megatron.core import parallel_state
    micro = parallel_state.get_pipeline_model_parallel_world_size() if len(ddps) > 1 else 1
    data = [iter([(ids, pos, mask)] * micro) for _ in ddps]
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data if len(ddps) > 1 else data[0],
                                model=ddps, num_microbatches=micro, seq_length=4, micro_batch_size=ids.shape[0],
                                forward_only=False)


def save_legacy(name, run, out, ddps, opt, sched, rank, layers, hidden):
    """Megatron-LM's save_checkpoint under `--ckpt-format torch` (training/checkpointing.py): the
    distributed optimizer's save_parameter_state on every rank (its data-parallel rank 0 writes
    distrib_optim.pt), then generate_state_dict's dict torch.saved by data-parallel rank 0 of each
    model-parallel rank (under a virtual pipeline each model chunk's state_dict as model<i>), and
    the tracker file. The reference: the sharded keys' whole state, as for the torch_dist runs, each
    stacked key unstacked into the state_dict's per-layer names."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    path = os.path.join(out, name)
    if rank == 0 and os.path.isdir(path):
        import shutil
        shutil.rmtree(path)
    dist.barrier()
    pp, ep = run.get("pp", 1), run.get("ep", 1)
    rank_dir = os.path.join(path, "iter_0000003", f"mp_rank_{tp_rank:02d}" +
                            (f"_{parallel_state.get_pipeline_model_parallel_rank():03d}" if pp > 1 else "") +
                            (f"_{parallel_state.get_expert_model_parallel_rank():03d}" if ep > 1 else ""))
    os.makedirs(rank_dir, exist_ok=True)
    if run["dist_opt"]:
        opt.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    state = {"args": argparse.Namespace(tensor_model_parallel_size=run["tp"], pipeline_model_parallel_size=pp,
                                        expert_model_parallel_size=ep,
                                        num_experts=2 if run.get("moe", ep > 1) else None,
                                        untie_embeddings_and_output_weights=not run.get("tied", False),
                                        num_layers=layers, hidden_size=hidden, lr=1e-3, weight_decay=0.1,
                                        bf16=run["bf16"], params_dtype=torch.bfloat16 if run["bf16"] else torch.float32,
                                        use_distributed_optimizer=run["dist_opt"], ckpt_format="torch",
                                        virtual_pipeline_model_parallel_size=run.get("vp")),
             "checkpoint_version": 3.0, "iteration": 3,
             **{("model" if len(ddps) == 1 else f"model{i}"): d.state_dict_for_save_checkpoint()
                for i, d in enumerate(ddps)},
             "optimizer": opt.state_dict(), "opt_param_scheduler": sched.state_dict(),
             "num_floating_point_operations_so_far": 0,
             "rng_state": [{"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}]}
    # every (tp, pp, ep) folder written once: data-parallel rank 0 writes the dense ranks', expert
    # data-parallel rank 0 the expert ranks' (the trainer's "dp_rank == 0 or expt_dp_rank == 0")
    if parallel_state.get_data_parallel_rank() == 0 or parallel_state.get_expert_data_parallel_rank() == 0:
        torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    model_sharded = {f"model{i}": d.module.sharded_state_dict(metadata=metadata) for i, d in enumerate(ddps)}
    built = {}
    for d in ddps:  # (a chunk's keys are its layers' local names: named below by their global layer)
        chunk = d.module.sharded_state_dict(metadata=metadata)
        apply_factories(chunk)  # SwiGLU's linear_fc1: two ShardedTensors (gate, up) of one key
        built.update({(id(d), k): st for k, st in chunk.items()})
    # the state_dict's name of each (sharded key, layer): the local spec renames its layer norms'
    # sharded keys (input_layernorm.weight -> self_attention.linear_qkv.layer_norm_weight)
    # (under pipeline parallelism each stage numbers its layers from 0: named by the global layer;
    # the last stage's copy of a tied embedding is the first stage's param)
    names = {}
    for (_, k), st in built.items():
        st = st[0] if isinstance(st, list) else st
        if hasattr(st, "prepend_axis_num"):
            offsets = tuple(st.global_offset[:st.prepend_axis_num])
            if offsets and k.startswith("decoder.layers."):
                k = "decoder.layers.{}.{}".format(offsets[0], k.split(".", 3)[3])
            if len(offsets) > 1 and ".local_experts." in k:  # an expert rank's experts numbered from 0
                head, rest = k.split(".local_experts.", 1)
                k = "{}.local_experts.{}.{}".format(head, offsets[1], rest.split(".", 1)[1])
            names.setdefault((st.key, offsets), k)
    merged = {}
    for part in all_ranks(names):
        for key, k in part.items():
            merged.setdefault(key, k)
    names = merged
    if run["dist_opt"]:
        rows = sharded_rows(nested_values(model_sharded)) + [r for d in ddps for r in live_rows(d.module, opt)]
    else:
        sharded = dict(model_sharded)
        sharded["optimizer"] = opt.sharded_state_dict(sharded, metadata=metadata)
        apply_factories(sharded)
        rows = sharded_rows(nested_values(sharded))
    whole = gathered(rows, rank)
    settings = {}
    for part in all_ranks({k: v for d in ddps for k, v in key_settings(d.module, opt).items()}):
        for key, v in part.items():
            assert settings.setdefault(key, v) == v, key
    if rank == 0:
        write_ref(path, whole, settings, names=names)
    dist.barrier()


def all_ranks(value):
    import torch.distributed as dist
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, value)
    return pieces


def key_settings(module, opt, prefix=""):
    """The step and group settings of each sharded key whose params this rank steps (a key's
    params, one per layer, share a group): from torch's AdamW (or apex's FusedAdam) under Megatron's optimizer, through
    Megatron's fp32 main params where it steps those."""
    of_param = {}
    for inner in getattr(opt, "chained_optimizers", [opt]):  # MoE's experts: an optimizer of their own
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                st = inner.optimizer.state.get(p, {})
                if "step" in st or (st and "step" in group):  # apex's FusedAdam: the group's step
                    of_param[id(p)] = {"step": int(float(st["step"] if "step" in st else group["step"])),
                                       "lr": float(group["lr"]),
                                       "betas": list(group["betas"]), "eps": group["eps"],
                                       "weight_decay": group["weight_decay"]}
        for model_attr, main_attr in (("float16_groups", "fp32_from_float16_groups"),
                                      ("model_float16_groups", "shard_fp32_from_float16_groups"),
                                      ("model_fp32_groups", "shard_fp32_groups")):
            for mg, fg in zip(getattr(inner, model_attr, None) or [], getattr(inner, main_attr, None) or []):
                for model_param, main_param in zip(mg, fg):
                    if id(main_param) in of_param:
                        of_param[id(model_param)] = of_param[id(main_param)]
    out = {}
    for st in module.sharded_state_dict(prefix=prefix).values():
        if hasattr(st, "key") and getattr(st, "data", None) is not None and id(st.data) in of_param:
            assert out.setdefault(st.key, of_param[id(st.data)]) == of_param[id(st.data)], st.key
    return out


def write_ref(path, whole, settings, names=None):
    """`names`: a legacy checkpoint's names, the state_dict's, by (sharded key, its offsets along the
    stacked axes): a stacked key's layers each under their own name."""
    tensors, meta = {}, {}
    for key in sorted(settings):
        prefix = next(p for p in ["", "chained_0.", "chained_1."] if f"{p}optimizer.state.exp_avg.{key}" in whole)

        main = whole.get(f"{prefix}optimizer.state.param.{key}", whole.get(f"{prefix}optimizer.state.fp32_param.{key}"))
        entries = {"param": main if main is not None else whole[key]}
        for e in ("exp_avg", "exp_avg_sq"):
            entries[e] = whole[f"{prefix}optimizer.state.{e}.{key}"]
        if names is not None:
            for (k, offsets), name in names.items():
                if k != key:
                    continue
                for e, t in entries.items():
                    tensors[f"{name}.{e}"] = t[offsets].contiguous() if offsets else t
                meta[name] = settings[key]
        else:
            for e, t in entries.items():
                tensors[f"{key}.{e}"] = t
            meta[key] = settings[key]
    save_ref(path, tensors, meta)


def main():
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    for world in sorted({run.get("world", 2) for run in runs().values()}):
        spawn_ranks(rank_main, out, world=world)


if __name__ == "__main__":
    main()
