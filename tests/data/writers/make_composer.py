"""Writes the checkpoint Composer's (MosaicML's) Trainer saves, for the writers corpus: run it where
`composer` imports (mosaicml, with torchvision or a stand-in for it: Composer imports torchvision
for its image helpers only), e.g.

    pip install --target /tmp/composer --no-deps mosaicml==0.32.1 coolname importlib_metadata \
        lazy_importer mosaicml-cli pillow ...
    PYTHONPATH=/tmp/composer python tests/data/writers/make_composer.py \
        tests/data/writers/mosaicml-0.32.1_torch-2.13.0

Composer's Trainer saves `ep0-ba3-rank0.pt`: torch.save of {"state": {"model", "optimizers":
{<optimizer class name>: state_dict keyed by fqn}, "schedulers", "timestamp", ...}, "rng": ...}.
Its DecoupledAdamW (llm-foundry's default) decays weights by weight_decay * lr / initial_lr a step,
not AdamW's weight_decay * lr. Written into OUT:

- `ep0-ba3-rank0.pt`: a ComposerClassifier over a 16 -> 33 -> 5 MLP, DecoupledAdamW in two groups
  (weight decay 1e-5 on the matrices, none on the vectors), a linear LR schedule (so lr is no
  longer initial_lr), 3 batches, one CPU process;
- `ep0-ba3-rank0.pt.ref.safetensors`: the state as Composer held it, named as optstate names it
  (the model's `module.` dropped, as every key has it), each param's `weight_decay` the AdamW
  equivalent (DecoupledAdamW's divided by initial_lr) and `composer_weight_decay` its own.
"""
import os
import sys
from pathlib import Path

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from composer.optim import DecoupledAdamW, LinearScheduler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch_versions"))
from make import hyperparameters, save_ref  # noqa: E402

NAME = "ep0-ba3-rank0.pt"


def main():
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    model = ComposerClassifier(net, num_classes=5)
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    opt = DecoupledAdamW([{"params": mats, "weight_decay": 1e-5}, {"params": vecs, "weight_decay": 0.0}],
                         lr=1e-3, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(12, 16, generator=g), torch.randint(0, 5, (12,), generator=g))
    trainer = Trainer(model=model, train_dataloader=torch.utils.data.DataLoader(data, batch_size=4), optimizers=opt,
                      schedulers=LinearScheduler(alpha_i=1.0, alpha_f=0.5, t_max="10ba"), max_duration="3ba",
                      device="cpu", save_folder=out, save_filename=NAME, save_interval="3ba", progress_bar=False,
                      loggers=[])
    trainer.fit()
    names = {p: n[len("module."):] for n, p in model.named_parameters()}
    tensors, meta = {}, {}
    for group in opt.param_groups:
        for p in group["params"]:
            st, fqn = opt.state[p], names[p]
            tensors[f"{fqn}.param"] = p.detach().float().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                tensors[f"{fqn}.{k}"] = st[k].float().clone()
            meta[fqn] = hyperparameters(st, group)
            meta[fqn]["composer_weight_decay"] = group["weight_decay"]
            meta[fqn]["weight_decay"] = group["weight_decay"] / group["initial_lr"]
    save_ref(os.path.join(out, NAME), tensors, meta)
    for f in os.listdir(out):  # Composer's latest-rank0.pt symlink
        if os.path.islink(os.path.join(out, f)):
            os.unlink(os.path.join(out, f))


if __name__ == "__main__":
    main()
