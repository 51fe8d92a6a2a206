"""Writes the checkpoint NeMo Automodel's recipes save, for the writers corpus: run it where
`nemo_automodel` imports (no GPU needed; its checkpoint module needs transformers, huggingface_hub,
fsspec and pyyaml beside torch), e.g.

    pip install --target /tmp/nemo --no-deps nemo_automodel==0.7.0 transformers==5.18.0 \
        huggingface_hub fsspec pyyaml packaging ...   # what `import` asks for
    PYTHONPATH=/tmp/nemo python tests/data/writers/make_nemo_automodel.py \
        tests/data/writers/nemo-automodel-0.7.0_torch-2.13.0

NeMo Automodel (NVIDIA's Hugging Face-native trainer) saves `checkpoints/epoch_E_step_S/` through
its `Checkpointer`: `model/` (`save_model`: a DCP of `get_model_state_dict(model)`, keys the
model's own FQNs, with `model_save_format: torch_save`; with `safetensors`, its default, Hugging
Face safetensors files that its storage writer names `shard-0000R-model-...`) and `optim/`
(`save_optimizer`: a DCP of `{"optim": get_optimizer_state_dict(model, optim)` flattened,
`"sched": scheduler.state_dict()}`). Written into OUT, from FSDP2 on two CPU ranks (gloo),
torch.optim.AdamW in two param groups (weight decay on the matrices only), a LambdaLR warm-up, a
33-row layer sharded unevenly (17 + 16 rows), as the recipe calls the Checkpointer:

- `torch_save_epoch_0_step_2/`: `model/` and `optim/`, both DCPs;
- `safetensors_epoch_0_step_2/`: `model/` in safetensors, `optim/` the DCP;
- `<folder>.ref.safetensors` beside each: the state as the run held it, gathered by torch over
  the ranks, named and described as `tests/data/torch_versions/make.py` does it (`write_ref`).
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch_versions"))
from make import adamw, fsdp2_sharded, join_gloo, small_model, spawn_main, train, write_ref  # noqa: E402


def rank_main(rank, world, port, out):
    import torch.distributed as dist

    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    join_gloo(rank, world, port)
    model = fsdp2_sharded(small_model)
    opt = adamw(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
    for step in range(2):
        train(model, opt, rank + 100 * step, steps=1)
        sched.step()
    for fmt in ("torch_save", "safetensors"):
        config = CheckpointingConfig(checkpoint_dir=out, model_save_format=fmt, save_consolidated=False)
        ckpt = Checkpointer(config, dp_rank=rank, tp_rank=0, pp_rank=0)
        path = os.path.join(out, f"{fmt}_epoch_0_step_2")  # the recipe's epoch_0_step_2, one per format
        os.makedirs(path, exist_ok=True)
        dist.barrier()
        ckpt.save_model(model=model, weights_path=path)
        ckpt.save_optimizer(opt, model, path, sched)
        ckpt.close()
        dist.barrier()
        write_ref(path, model, opt, gather=rank)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_main(rank_main)
