"""Writes the checkpoint OLMo-core's Trainer saves, for the writers corpus: run it where
`olmo_core` imports (ai2-olmo-core; no GPU needed), e.g.

    pip install --target /tmp/olmo ai2-olmo-core==3.0.0   # and its pure-Python deps
    PYTHONPATH=/tmp/olmo python tests/data/writers/make_olmo_core.py \
        tests/data/writers/olmo-core-3.0.0_torch-2.13.0

OLMo-core (the OLMo 2 / OLMo 3 trainer) saves `stepN/model_and_optim/` as a DCP of
`{"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}` with
`flatten_optimizer_state_dict=True`, through its own storage writer (`RemoteFileSystemWriter`),
whose `.metadata` pickles OLMo-core's own `_StorageInfo` class for every item: torch's reader
cannot unpickle it without olmo_core installed. Written into OUT:

- `model_and_optim/`: that DCP, saved by `olmo_core.distributed.checkpoint.save_model_and_optim_state`
  (what the Trainer calls, with the Trainer's flattening) from FSDP2 on two CPU ranks (gloo), the
  optimizer OLMo-core's `SkipStepAdamW` (AdamW's update, skipped on loss spikes) in two param groups
  (weight decay on the matrices only), a 33-row layer sharded unevenly (17 + 16 rows);
- `model_and_optim.ref.safetensors`: the state as OLMo-core held it, gathered by torch over the
  ranks, named and described as `tests/data/torch_versions/make.py` does it (`write_ref`).
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch_versions"))
from make import fsdp2_sharded, join_gloo, small_model, spawn_main, train, write_ref  # noqa: E402


def rank_main(rank, world, port, out):
    import torch.distributed as dist

    import olmo_core.distributed.checkpoint as olmo_checkpoint
    from olmo_core.optim import SkipStepAdamW

    join_gloo(rank, world, port)
    model = fsdp2_sharded(small_model)
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    opt = SkipStepAdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0}],
                        lr=1e-3, betas=(0.9, 0.95))
    train(model, opt, rank)
    path = os.path.join(out, "model_and_optim")
    olmo_checkpoint.save_model_and_optim_state(path, model, opt, flatten_optimizer_state=True,
                                               save_overwrite=True)
    write_ref(path, model, opt, gather=rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_main(rank_main)
