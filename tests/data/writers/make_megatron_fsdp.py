"""Writes Megatron-LM's `--ckpt-format fsdp_dtensor` checkpoints (Megatron-FSDP, `--use-megatron-fsdp`)
for the writers corpus, with Megatron-Core 0.19's own Megatron-FSDP and distributed optimizer on two
CPU ranks (gloo), e.g.

    git -C Megatron-LM archive core_v0.19.0 megatron/core | tar -x -C /tmp/mcore19
    pip install --target /tmp/mc19deps --no-deps triton
    PYTHONPATH=/tmp/mcore19:/tmp/mc19deps python tests/data/writers/make_megatron_fsdp.py \
        tests/data/writers/megatron-core-0.19.0_torch-2.13.0

Megatron-LM saves such a checkpoint with torch's DCP alone (`torch.distributed.checkpoint.save`,
no `metadata.json`, no common.pt): `iter_0000003/` holds `{"args", "checkpoint_version",
"iteration", "model", "optimizer", "opt_param_scheduler", "rng_state"}`, where the model's weights
and the optimizer's moments are Megatron-FSDP's DTensors (each rank's shard of each param, uneven
where the flat buffer splits a param: their chunk lists set by Megatron-FSDP's
`preprocess_state_dict_for_uneven_dtensor`), and the optimizer's state dict is its
`sharded_param_state_fsdp_dtensor`: `{"state": {name: {"exp_avg", "exp_avg_sq", "step"}},
"param_to_group_meta": {name: the param's group without "params"}}`, no `param_groups`.

What runs is Megatron-Core's: GPTModel under `FullyShardedDataParallel`
(`data_parallel_sharding_strategy="optim_grads_params"`, the distributed optimizer over it), three
training steps, `DistributedOptimizer.sharded_state_dict(..., metadata={"distrib_optim_sharding_type":
"fsdp_dtensor"})`. What is Megatron-LM's (`megatron/training/checkpointing.py` at core_v0.19.0, not
importable without its trainer's stack) is followed line by line: `generate_state_dict`'s keys,
`get_rng_state`'s `{"(pp, tp)": [rng_state]}`, `preprocess_fsdp_dtensor_state_dict` (its calls into
Megatron-Core: handle_fp8_extra_state_case, handle_swiglu_in_state_dict under swiglu,
preprocess_state_dict_for_uneven_dtensor) and the save through a FileSystemWriter into
`iter_0000003/`, with `latest_checkpointed_iteration.txt` beside.

Megatron-FSDP needs CUDA; on the CPU here (make_megatron.py's cpu_shim, and more): streams and
events that do nothing (each collective runs synchronously), `torch.cuda.current_device()` 0 with
device 0 taken as the CPU, gloo's missing reduce-scatter done as an all-reduce keeping this rank's
slice, every collective run to its end before it returns (Megatron-FSDP waits on stream events
for the gathers it starts asynchronously, not on gloo's work), and `gradient_reduce_div_fusion=False` (NCCL's PREMUL_SUM: gloo has none; the gradients are
scaled before a SUM instead, as Megatron-FSDP does for bf16).

- `fsdp_dtensor_dp2/`: data parallel 2, fp32, 2 layers of hidden 8;
- `fsdp_dtensor_dp2_bf16/`: the same in bf16 (Megatron-FSDP's fp32 main params in the optimizer);
- no SwiGLU run: 0.19's save splits `linear_fc1` by looking each key up as `module.<key>` in
  the unwrapped model, one level too deep for Megatron-FSDP's (`GPTModel has no attribute
  module`; Megatron-LM issue #5265, "Cannot save optimizer when swiglu and FSDP");
- `<run>/iter_0000003.ref.safetensors`: each saved param's state (`<name>.param`: the model state dict's weight,
  Megatron-FSDP's fp32 main param under bf16 too; `<name>.exp_avg`, `<name>.exp_avg_sq`), named
  without the wrappers' leading `module.`, as the state dict handed to DCP holds it, gathered over
  the ranks by the chunk lists Megatron-FSDP set, with its step and group settings as
  `tests/data/torch_versions/make.py` records them.
"""
import argparse
import contextlib
import os
import random
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch_versions"))
import make_megatron  # noqa: E402
from make import save_ref, spawn_ranks  # noqa: E402

RUNS = {
    "fsdp_dtensor_dp2": dict(bf16=False, swiglu=False),
    "fsdp_dtensor_dp2_bf16": dict(bf16=True, swiglu=False),
}
ITERATION = 3


def megatron_fsdp_cpu_shim():
    """What Megatron-FSDP needs of CUDA, on the CPU (see above)."""
    make_megatron.cpu_shim()

    class Nothing:  # a stream or an event: waits, records and synchronizes at once
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: Nothing()

        def query(self):
            return True

    torch.cuda.Stream = torch.cuda.Event = Nothing
    torch.cuda.current_stream = lambda *a, **k: Nothing()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_device = lambda: 0
    from torch.overrides import TorchFunctionMode

    class DeviceZeroIsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if isinstance(kwargs.get("device"), int):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    DeviceZeroIsCpu().__enter__()
    import torch.distributed as dist

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        whole = input.detach().clone()
        dist.all_reduce(whole, op=op, group=group)
        r, n = dist.get_rank(group), output.numel()
        output.copy_(whole.view(-1)[r * n:(r + 1) * n].view_as(output))

    dist.reduce_scatter_tensor = reduce_scatter_tensor
    # Megatron-FSDP starts its gathers async_op=True and waits on the stream's event, not on the
    # work: here each collective runs to its end before it returns
    for name in ("all_gather_into_tensor", "all_reduce", "all_gather", "broadcast"):
        def synchronous(*a, _run=getattr(dist, name), async_op=False, **k):
            _run(*a, **k)
            return Nothing() if async_op else None
        setattr(dist, name, synchronous)
    import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb

    @contextlib.contextmanager
    def coalescing(*a, **k):
        yield Nothing()  # the collectives inside have run

    pgb._coalescing_manager = coalescing


def rng_state_of(rank):
    """get_rng_state(ckpt_format="fsdp_dtensor") of Megatron-LM at pp 0, tp 0 (no data_parallel_random_init:
    a list of this rank's one state; no CUDA generator here)."""
    import numpy as np
    from megatron.core import tensor_parallel
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return {"(0, 0)": [state]}


def rank_main(rank, world, port, out):
    import faulthandler
    faulthandler.enable()
    megatron_fsdp_cpu_shim()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (handle_fp8_extra_state_case,
                                                                   handle_swiglu_in_state_dict)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import unwrap_model

    chosen = os.environ.get("MEGATRON_RUNS")
    for name, run in RUNS.items():
        if chosen and name not in chosen.split(","):
            continue
        parallel_state.initialize_model_parallel(1, 1)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if run["bf16"] else torch.float32
        cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                                hidden_dropout=0.0, attention_dropout=0.0, bf16=run["bf16"], params_dtype=dtype,
                                pipeline_dtype=dtype,
                                **(dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
                                   if run["swiglu"] else {}))
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16,
                         max_sequence_length=4)
        if run["bf16"]:  # as Megatron-LM's get_model wraps it, before Megatron-FSDP does
            from megatron.core.transformer.module import Float16Module
            model = Float16Module(cfg, model)
        ddp = FullyShardedDataParallel(
            config=cfg, module=model, device=torch.device("cpu"),
            ddp_config=DistributedDataParallelConfig(
                use_distributed_optimizer=True, use_megatron_fsdp=True,
                data_parallel_sharding_strategy="optim_grads_params", grad_reduce_in_fp32=True,
                gradient_reduce_div_fusion=False))
        lr = 1e-3
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.1,
                                                     adam_beta2=0.95, bf16=run["bf16"],
                                                     use_distributed_optimizer=True), [ddp])
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=10, wd_incr_style="constant")
        gen = torch.Generator().manual_seed(1 + rank)
        for _ in range(ITERATION):
            ids = torch.randint(0, 16, (2, 4), generator=gen)
            pos = torch.arange(4).unsqueeze(0).expand(2, 4)
            mask = torch.tril(torch.ones(4, 4, dtype=torch.bool)).logical_not().view(1, 1, 4, 4)
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ddp(ids, pos, mask, labels=ids).float().mean().backward()
            ddp.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok
            sched.step(1)

        # A param whose shard on this rank is empty gets no gradient there (update_main_grads), so
        # no state: the ranks' state dicts would differ and the save's per-DTensor collectives
        # (preprocess_state_dict_for_uneven_dtensor) hang, as Megatron-LM issue #4910 reports.
        # Megatron's own init_state_fn (what its other formats call before a save) gives those
        # params their zero moments, empty here, as a run that saves must hold them.
        opt.init_state_fn(opt.optimizer, opt.config)
        # Megatron-LM's generate_state_dict for ckpt_format "fsdp_dtensor"
        args = argparse.Namespace(ckpt_format="fsdp_dtensor", use_megatron_fsdp=True, use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy="optim_grads_params", num_layers=2, hidden_size=8,
                                  swiglu=run["swiglu"], bf16=run["bf16"], num_experts=None, lr=lr, iteration=ITERATION)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                 "model": ddp.state_dict_for_save_checkpoint()}
        state["optimizer"] = opt.sharded_state_dict(state, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
        state["opt_param_scheduler"] = sched.state_dict()
        state["rng_state"] = rng_state_of(rank)
        # preprocess_fsdp_dtensor_state_dict
        handle_fp8_extra_state_case(state["model"])
        if args.swiglu:  # save_checkpoint's model: unwrap_model(model)
            state["model"], state["optimizer"] = handle_swiglu_in_state_dict(unwrap_model(ddp), state["model"],
                                                                             state["optimizer"])
        preprocess_state_dict_for_uneven_dtensor(state)

        save_dir = os.path.join(out, name)
        path = os.path.join(save_dir, f"iter_{ITERATION:07d}")
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dcp.save(state_dict=state, storage_writer=dcp.FileSystemWriter(path))
        if rank == 0:
            with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))

        def whole(dt):
            """A DTensor of Megatron-FSDP's put together from every rank's chunk (its chunk list's
            offsets: uneven_dtensor_to_full_tensor's gather of unequal sizes, which gloo lacks)."""
            chunk = dt.__create_chunk_list__()[0]
            pieces = [None] * world
            dist.all_gather_object(pieces, (list(chunk.offsets), dt.to_local().detach().float().clone()))
            out = torch.zeros(dt.shape)
            for offsets, local in pieces:
                out[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))] = local
            return out

        # the reference: what was handed to DCP, whole; each param's step from the rank that stepped it
        steps = [None] * world
        dist.all_gather_object(steps, {n: int(st["step"]) for n, st in state["optimizer"]["state"].items()
                                       if "step" in st})
        tensors, meta = {}, {}
        groups = state["optimizer"]["param_to_group_meta"]
        for pname, st in sorted(state["optimizer"]["state"].items()):
            # named as optstate reads them: without the wrappers' leading module. (all share it)
            ref_name = re.sub(r"^(module\.)+", "", pname)
            for e in ("exp_avg", "exp_avg_sq"):
                tensors[f"{ref_name}.{e}"] = whole(st[e])
            # the weights: the model's state dict holds Megatron-FSDP's fp32 main params (bf16 too)
            main = next(w for n, w in state["model"].items() if re.sub(r"^(module\.)+", "", n) == ref_name)
            tensors[f"{ref_name}.param"] = whole(main)
            g = groups[pname]
            step = max(s.get(pname, 0) for s in steps) if any(pname in s for s in steps) else int(g["step"])
            meta[ref_name] = {"step": step,
                           "lr": float(g["lr"]), "betas": list(g["betas"]), "eps": g["eps"],
                           "weight_decay": g["weight_decay"]}
        if rank == 0:
            save_ref(path, tensors, meta)
            print(name, "state keys:", sorted(state["optimizer"]["state"])[:4], "...",
                  "entries:", sorted(next(iter(state["optimizer"]["state"].values()))),
                  "model keys:", sorted(state["model"])[:3], flush=True)
        dist.barrier()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main():
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    spawn_ranks(rank_main, out)


if __name__ == "__main__":
    main()
