"""Writes the checkpoints nanotron's trainer saves (huggingface/nanotron, which trains SmolLM),
for the writers corpus: run it where `nanotron` imports (its source tree's src/ on PYTHONPATH, with
dacite, pyyaml and tqdm; no GPU, flash-attn, transformers or datasets needed: the shim below stubs
the modules nanotron imports but saving never runs, and points its CUDA devices at the CPU), e.g.

    git clone https://github.com/huggingface/nanotron /tmp/nanotron
    pip install --target /tmp/ntdeps --no-deps dacite pyyaml tqdm
    PYTHONPATH=/tmp/nanotron/src:/tmp/ntdeps python tests/data/writers/make_nanotron.py \\
        tests/data/writers/nanotron-2411b02_torch-2.13.0

nanotron saves `checkpoints/<step>/` through `nanotron.serialize`: `model/` (a safetensors file per
param and tensor-parallel rank), `optimizer/` (torch.save of each pipeline stage's NamedOptimizer
state_dict: torch.optim.AdamW's, its params named by an added 'names' dict and, with fp32 gradient
accumulation, their fp32 weights under 'gradient_accumulator'; under ZeRO-1 a file per data-parallel
rank holding 1-D runs of each param, placed by `optimizer_config.json`). Each run builds nanotron's
LlamaForTraining (2 layers, hidden 16, grouped-query attention) in bf16 with nanotron's own
build_model and tied-parameter marking, its optimizer by nanotron's init_optimizer_and_grad_accumulator
(a param group per param, as nanotron makes them; fp32 gradient accumulation, weight decay 0.1), and
steps it 3 times on seeded gradients put through the accumulator as its backward does (nanotron's
forward needs flash-attn), its learning-rate schedule (linear warmup, cosine decay) with it; then
saves the model, optimizer, schedule and checkpoint metadata with nanotron's save_weights,
save_optimizer, save_lr_scheduler and save_meta, over 2 or 4 CPU ranks (gloo). Written into OUT:

- `dp2/`: data parallel 2 without ZeRO (rank 0 saves the one optimizer file);
- `dp2_zero1/`: ZeRO-1 over 2 data-parallel ranks (each saves its runs);
- `pp2/`: pipeline parallel 2 (a file per stage, each naming its own params);
- `tp2/`: tensor parallel 2 (each rank's shards, placed by the model folder's shard metadata);
- `pp2_dp2_zero1/`, `tp2_dp2_zero1/` (4 ranks): ZeRO-1 under pipeline parallelism (the config
  holds stage 0's runs only) and under tensor parallelism (runs of each shard);
- `pp2_tied/`: pipeline parallel 2 with tied word embeddings (SmolLM's): the embedding and the
  output head are one param, stepped on both stages (its gradients summed over the tie), each
  stage's file holding its state;
- `<run>.ref.safetensors`: what the optimizer held, per param (`<name>.param`: the fp32 weights,
  `<name>.exp_avg`, `<name>.exp_avg_sq`), gathered from every rank's live optimizer (ZeRO-1's runs
  placed by its own param_name_to_dp_rank_offsets, tensor-parallel shards by Python's slicing of
  the live params' ShardedInfo), with each param's step and group settings as
  `tests/data/torch_versions/make.py` records them.
"""
import importlib.abc
import importlib.machinery
import os
import pathlib
import sys
import types
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch_versions"))
from make import enter_cpu_mode, hyperparameters, save_ref, spawn_ranks  # noqa: E402

RUNS = {  # each over tp * pp * dp ranks
    "dp2": dict(tp=1, pp=1, dp=2, zero=0),
    "dp2_zero1": dict(tp=1, pp=1, dp=2, zero=1),
    "pp2": dict(tp=1, pp=2, dp=1, zero=0),
    "tp2": dict(tp=2, pp=1, dp=1, zero=0),
    "pp2_dp2_zero1": dict(tp=1, pp=2, dp=2, zero=1),
    "tp2_dp2_zero1": dict(tp=2, pp=1, dp=2, zero=1),
    # SmolLM's tied embeddings: the input embedding and the output head one param, on both stages
    "pp2_tied": dict(tp=1, pp=2, dp=1, zero=0, tied=True),
}
# bench/bench_nanotron.py's larger model: NANOTRON_SIZE="layers,hidden,vocab", NANOTRON_RUNS a
# comma-separated subset of RUNS, NANOTRON_REF=0 (no .ref.safetensors: nothing gathered).
LAYERS, HIDDEN, VOCAB = map(int, os.environ.get("NANOTRON_SIZE", "2,16,64").split(","))
if os.environ.get("NANOTRON_RUNS"):
    RUNS = {k: RUNS[k] for k in os.environ["NANOTRON_RUNS"].split(",")}
# Imported by nanotron's modules, never run by a save.
STUBS = ("flash_attn", "transformers", "datasets", "triton", "wandb", "grouped_gemm", "transformer_engine")


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []

        def __getattr__(attr):
            if attr == "__version__":
                return "0.0"
            if attr.startswith("__"):
                raise AttributeError(attr)
            if attr == "xPath":  # datasets' path type, used as a path
                return pathlib.Path
            return type(attr, (), {"__init__": lambda self, *a, **k: None})
        m.__getattr__ = __getattr__
        return m

    def exec_module(self, m):
        pass


def cpu_shim():
    """nanotron places tensors on device='cuda' and sets each rank's CUDA device: the CPU here."""
    sys.meta_path.insert(0, _Stubs())
    enter_cpu_mode()
    from nanotron.parallel.context import ParallelContext
    ParallelContext.set_device = lambda self: None


def rank_main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), CUDA_DEVICE_MAX_CONNECTIONS="1")
    cpu_shim()
    import torch.distributed as tdist
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    from nanotron import distributed as dist
    from nanotron.config import AdamWOptimizerArgs, LRSchedulerArgs, OptimizerArgs, ParallelismArgs
    from nanotron.config.models_config import LlamaConfig
    from nanotron.helpers import init_optimizer_and_grad_accumulator, lr_scheduler_builder
    from nanotron.models.base import build_model
    from nanotron.models.llama import LlamaForTraining
    from nanotron.optim.zero import ZeroDistributedOptimizer
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.tensor_parallel.nn import TensorParallelLinearMode
    from nanotron.parallel.tied_parameters import sync_tied_weights_gradients
    from nanotron.scaling.parametrization import ParametrizationMethod
    from nanotron.serialize.metadata import DataStageMetadata, TrainingMetadata, save_meta
    from nanotron.serialize.optimizer import save_lr_scheduler, save_optimizer
    from nanotron.serialize.weights import save_weights
    from nanotron.trainer import mark_tied_parameters

    for run, cfg in RUNS.items():
        if cfg["tp"] * cfg["pp"] * cfg["dp"] != world:
            continue
        pc = ParallelContext(tensor_parallel_size=cfg["tp"], pipeline_parallel_size=cfg["pp"],
                             data_parallel_size=cfg["dp"])
        par = ParallelismArgs(dp=cfg["dp"], pp=cfg["pp"], tp=cfg["tp"], tp_mode=TensorParallelLinearMode.ALL_REDUCE,
                              tp_linear_async_communication=False)
        config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=LAYERS, vocab_size=VOCAB, max_position_embeddings=32,
                             tie_word_embeddings=cfg.get("tied", False))
        model = build_model(lambda: LlamaForTraining(config=config, parallel_context=pc, parallel_config=par),
                            parallel_context=pc, dtype=torch.bfloat16, device=torch.device("cpu"))
        mark_tied_parameters(model=model, parallel_context=pc, parallel_config=par)
        tp_rank = dist.get_rank(pc.tp_pg)
        with torch.no_grad():  # seeded by name (and shard): a param's copies and replicas alike
            for name, p in full_names(model).items():
                shard = tp_rank if p.is_sharded and cfg["tp"] > 1 else 0
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * shard)
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        opt_args = OptimizerArgs(
            optimizer_factory=AdamWOptimizerArgs(adam_eps=1e-8, adam_beta1=0.9, adam_beta2=0.95,
                                                 torch_adam_is_fused=False),
            zero_stage=cfg["zero"], weight_decay=0.1, clip_grad=1.0, accumulate_grad_in_fp32=True,
            learning_rate_scheduler=LRSchedulerArgs(learning_rate=3e-4, lr_warmup_steps=2, lr_warmup_style="linear",
                                                    lr_decay_style="cosine", min_decay_lr=3e-5))
        optimizer, accumulator = init_optimizer_and_grad_accumulator(
            parametrization_method=ParametrizationMethod.STANDARD, model=model, optimizer_args=opt_args,
            parallel_context=pc)
        lr_scheduler = lr_scheduler_builder(optimizer=optimizer, lr_scheduler_args=opt_args.learning_rate_scheduler,
                                            total_training_steps=10)
        for step in range(3):
            gs = torch.Generator().manual_seed(100 + step + 1000 * tp_rank)
            for _, p in model.named_parameters():
                p.grad = torch.randn(p.shape, generator=gs).to(p.dtype)
            for name, elt in accumulator.fp32_grad_buffers.items():  # what its backward does after autograd
                accumulator._accumulate_grad(name=name, half_param=elt["half"])
            # as the trainer does: a tied param's gradients (copies across tensor-parallel ranks,
            # embeddings tied across pipeline stages) summed over its ties
            sync_tied_weights_gradients(module=model, parallel_context=pc, grad_accumulator=accumulator)
            optimizer.step()
            optimizer.zero_grad()
            lr_scheduler.step()
        root = Path(out) / run
        save_weights(model=model, parallel_context=pc, root_folder=root)
        save_optimizer(optimizer=optimizer, parallel_context=pc, root_folder=root)
        save_lr_scheduler(lr_scheduler=lr_scheduler, is_zero=cfg["zero"] > 0, parallel_context=pc, root_folder=root)
        save_meta(parallel_context=pc, root_folder=root, training_metadata=TrainingMetadata(
            consumed_train_samples=12, last_train_step=3, last_stage_idx=0,
            data_stages=[DataStageMetadata(name="stable", start_training_step=1, consumed_train_samples=12)]))
        zero = optimizer.param_name_to_dp_rank_offsets if isinstance(optimizer, ZeroDistributedOptimizer) else None
        if os.environ.get("NANOTRON_REF") != "0":
                write_ref(str(root), optimizer.state_dict(), model, zero, dist.get_rank(pc.dp_pg), tp_rank, rank)
        tdist.barrier()


def full_names(model):
    """The model's params by the names nanotron's optimizer gives them (a tied param's full name)."""
    prefixes = {id(m): f"{n}." for n, m in model.named_modules()} | {id(model): ""}
    return {p.get_tied_info().get_full_name_from_module_id_to_prefix(module_id_to_prefix=prefixes)
            if p.is_tied else name: p for name, p in model.named_parameters()}


def write_ref(path, sd, model, zero, dp_rank, tp_rank, rank):
    """Each param whole, from every rank's live state: ZeRO-1's runs at their offsets in the rank's
    local tensor, tensor-parallel shards put in the whole tensor by Python's own slicing of the live
    params' ShardedInfo (tensor-parallel rank 0's copy of a param no rank shards)."""
    import torch.distributed as tdist
    params = full_names(model)
    mine = []
    for index, name in sd["names"].items():
        st, p = sd["state"][index], params[name]
        group = next(g for g in sd["param_groups"] if index in g["params"])
        run = tuple(int(x) for x in zero[name][dp_rank]) if zero is not None else None
        sharded = p.is_sharded and p.get_sharded_info().global_ranks != (rank,)
        if not sharded and tp_rank != 0:
            continue
        layout = (p.get_sharded_info().local_global_slices_pairs, tuple(p.get_sharded_info().unsharded_shape)) \
            if sharded else None
        parts = {"param": sd["gradient_accumulator"][name], "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
        mine.append((name, tp_rank, tuple(p.shape), run, layout,
                     {k: v.detach().float().reshape(-1).clone() for k, v in parts.items()}, hyperparameters(st, group)))
    gathered = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, mine)
    if rank != 0:
        return
    local, layouts, meta = {}, {}, {}  # (name, tp, shape) -> {key: flat local tensor}; (name, tp) -> layout
    for part in gathered:
        for name, tp, shape, run, layout, parts, settings in part:
            for k, v in parts.items():
                t = local.setdefault((name, tp, shape), {}).setdefault(k, torch.full((torch.Size(shape).numel(),), float("nan")))
                start, end = run if run is not None else (0, t.numel())
                # a copy held twice (a replica, a param tied across stages) must be the same
                assert t[start:end].isnan().all() or torch.equal(t[start:end], v), (name, tp, k)
                t[start:end] = v
            layouts[name, tp] = layout
            assert meta.setdefault(name, settings) == settings, name
    tensors = {}
    for (name, tp, shape), parts in local.items():
        for k, flat in parts.items():
            assert not flat.isnan().any(), (name, tp, k)
            if layouts[name, tp] is None:
                tensors[f"{name}.{k}"] = flat.reshape(shape).contiguous()
                continue
            pairs, whole = layouts[name, tp]
            t = tensors.setdefault(f"{name}.{k}", torch.full(whole, float("nan")))
            for pair in pairs:
                t[pair.global_slices] = flat.reshape(shape)[pair.local_slices]
    for k, t in tensors.items():
        assert not t.isnan().any(), k
    save_ref(path, tensors, meta)


def main():
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    for world in sorted({c["tp"] * c["pp"] * c["dp"] for c in RUNS.values()}):
        spawn_ranks(rank_main, out, world=world)


if __name__ == "__main__":
    main()
