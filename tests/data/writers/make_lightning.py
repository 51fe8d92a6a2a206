"""Writes the checkpoint Lightning's Trainer saves under FSDP with sharded state dicts, for the
writers corpus: run it where `lightning` imports (pure Python; no GPU needed here), e.g.

    pip install --target /tmp/lightning --no-deps lightning==2.6.6 lightning-utilities torchmetrics
    PYTHONPATH=/tmp/lightning python tests/data/writers/make_lightning.py \
        tests/data/writers/lightning-2.6.6_torch-2.13.0

`Trainer(strategy=FSDPStrategy(state_dict_type="sharded")).save_checkpoint(path)` makes `path` a
folder: a DCP of `{"model": <FSDP1 sharded state dict>, "optimizer_0": FSDP.optim_state_dict(...)}`
(keyed by fqn, ShardedTensors) and, beside it, `meta.pt`: torch.save of the rest of Lightning's
checkpoint (epoch, global_step, loops, callbacks, LR schedulers), without which Lightning does not
take the folder for its checkpoint. Written into OUT:

- `epoch=0-step=3.ckpt/`: that folder, from two CPU ranks (gloo; Lightning's FSDP wants CUDA, so
  its check is passed by a subclass of the strategy and FSDP1 is given the CPU as its device), the
  LightningModule a 16 -> 33 -> 5 MLP under torch.optim.AdamW (weight decay 0.1), 3 steps;
- `epoch=0-step=3.ckpt.ref.safetensors`: the state as torch itself reads the DCP back
  (`dcp_to_torch_save`), named and described as `tests/data/torch_versions/make.py` does it.
"""
import os
import sys
from pathlib import Path

import torch
import lightning as L
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch_versions"))
from make import hyperparameters, save_ref  # noqa: E402

NAME = "epoch=0-step=3.ckpt"

_fsdp_init = FSDP.__init__


def _fsdp_on_cpu(self, *args, **kwargs):
    # FSDP1 needs device_id=cpu to run on the CPU; Lightning passes the device's index (None there)
    if kwargs.get("device_id") is None:
        kwargs["device_id"] = torch.device("cpu")
    _fsdp_init(self, *args, **kwargs)


FSDP.__init__ = _fsdp_on_cpu


class CpuFSDPStrategy(FSDPStrategy):
    """Lightning refuses FSDP without CUDA by `type(strategy) is FSDPStrategy`."""


class MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))

    def training_step(self, batch, index):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


def write_torch_ref(path):
    """torch's own reading of the folder's DCP (format_utils.dcp_to_torch_save, one process), saved by
    rank 0 as the reference. (Not FSDP.optim_state_dict under FULL_STATE_DICT: under Lightning's
    FSDP1 set-up its gathered exp_avg and exp_avg_sq share one buffer, both holding exp_avg_sq.)"""
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        return
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "full.pt"))
        full = torch.load(os.path.join(tmp, "full.pt"), weights_only=False)
    (group,) = full["optimizer_0"]["param_groups"]
    tensors, meta = {}, {}
    for fqn, st in full["optimizer_0"]["state"].items():
        tensors[f"{fqn}.param"] = full["model"][fqn].float().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            tensors[f"{fqn}.{k}"] = st[k].float().clone()
        meta[fqn] = hyperparameters(st, group)
    save_ref(path, tensors, meta)


def main():
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    data = torch.utils.data.TensorDataset(torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))
    strategy = CpuFSDPStrategy(state_dict_type="sharded", auto_wrap_policy={torch.nn.Linear},
                               process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(MLP(), torch.utils.data.DataLoader(data, batch_size=4))
    path = os.path.join(out, NAME)
    trainer.save_checkpoint(path)
    write_torch_ref(path)


if __name__ == "__main__":
    main()
