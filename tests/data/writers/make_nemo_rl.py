"""Writes the checkpoints NeMo RL's DTensor policy workers save, for the writers corpus: run it with
NeMo RL's source importable (not on PyPI: its repository's `nemo_rl/` folder, here 0.6.0 at
7ea279a) and the nemo_automodel it pins (its 3rdparty/Automodel-workspace submodule, Automodel at
24b47e8, 0.4.0: PyPI's 0.7.0 lacks what NeMo RL calls), with what make_nemo_automodel.py installs
for nemo_automodel's imports (no GPU, Ray or vLLM needed), e.g.

    git -C RL archive HEAD nemo_rl | tar -x -C /tmp/nemorl_src
    git -C Automodel archive 24b47e8 nemo_automodel | tar -x -C /tmp/nemo_am
    PYTHONPATH=/tmp/nemo_am:/tmp/nemo:/tmp/nemorl_src python tests/data/writers/make_nemo_rl.py \
        tests/data/writers/nemo-rl-0.6.0_torch-2.13.0

NeMo RL (NVIDIA's post-training library: GRPO, DPO, SFT) keeps `results/<run>/step_N/` through its
`CheckpointManager` (`training_info.json` written into `tmp_step_N/`, renamed to `step_N/` once the
policy is saved) and the policy worker's `save_checkpoint(weights_path=step_N/policy/weights,
optimizer_path=step_N/policy/optimizer)`:

- `dtensor_v2/step_2/`: the default worker (`dtensor_cfg._v2: true`), through its
  `AutomodelCheckpointManager`, i.e. NeMo Automodel's Checkpointer: `policy/weights/model/` (the
  default `model_save_format: safetensors`: DCP's Hugging Face storage) and
  `policy/optimizer/optim/` (a DCP of `{"optim": flattened optimizer state, "sched": ...}`);
- `dtensor_v1/step_2/`: the first worker (`_v2: false`), through `nemo_rl.utils.native_checkpoint`:
  `policy/weights/`, a DCP of `{"model": get_model_state_dict(model)}`, and `policy/optimizer/`, a DCP of
  `{"optim": {"optim": get_optimizer_state_dict(...), "sched": scheduler.state_dict()}}`;
- `<step folder>.ref.safetensors` beside each: the state as the run held it, gathered by torch over
  the ranks (`tests/data/torch_versions/make.py`'s `write_ref`).

FSDP2 on two CPU ranks (gloo) over a ("dp", "tp") mesh of 2 x 1 as the worker builds it,
torch.optim.AdamW in two param groups, the scheduler of NeMo RL's example configs (a linear warm-up
then constant: SequentialLR), a 33-row layer sharded unevenly (17 + 16 rows). The run config
(`config.yaml`) is left out: the CheckpointManager writes it from the whole run's pydantic config.
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch_versions"))
from make import adamw, join_gloo, small_model, spawn_main, train, write_ref  # noqa: E402


def scheduler(opt):
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=50)
    constant = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=10_000_000_000)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, constant], milestones=[50])


def rank_main(rank, world, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nemo_rl.models.automodel.checkpoint import AutomodelCheckpointManager
    from nemo_rl.utils.checkpoint import CheckpointManager
    from nemo_rl.utils.native_checkpoint import save_checkpoint

    join_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    model = small_model()
    for m in list(model)[::2] + [model]:
        fully_shard(m, mesh=mesh["dp"])
    opt = adamw(model)
    sched = scheduler(opt)
    for step in range(2):
        train(model, opt, rank + 100 * step, steps=1)
        sched.step()

    for worker in ("dtensor_v2", "dtensor_v1"):
        config = {"enabled": True, "checkpoint_dir": os.path.join(out, worker), "metric_name": None,
                  "higher_is_better": True, "save_period": 2, "keep_top_k": 3, "save_optimizer": True,
                  "model_save_format": "safetensors", "save_consolidated": False}
        checkpointer = CheckpointManager(config)
        tmp = os.path.join(out, worker, "tmp_step_2")
        if rank == 0:  # the driver's part, one process
            checkpointer.init_tmp_checkpoint(2, {"consumed_samples": 16, "current_step": 2, "total_steps": 2})
        dist.barrier()
        weights, optimizer = os.path.join(tmp, "policy", "weights"), os.path.join(tmp, "policy", "optimizer")
        if worker == "dtensor_v2":
            manager = AutomodelCheckpointManager(dp_mesh=mesh["dp"], tp_mesh=mesh["tp"])
            manager.init_checkpointer(config_updates={"model_repo_id": "", "is_peft": False})
            manager.save_checkpoint(model=model, weights_path=weights, optimizer=opt, optimizer_path=optimizer,
                                    scheduler=sched, checkpointing_cfg=config)
            manager.checkpointer.close()
        else:
            save_checkpoint(model=model, weights_path=weights, optimizer=opt, scheduler=sched,
                            optimizer_path=optimizer)
        dist.barrier()
        if rank == 0:
            checkpointer.finalize_checkpoint(tmp)
        dist.barrier()
        write_ref(os.path.join(out, worker, "step_2"), model, opt, gather=rank)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_main(rank_main)
