"""Writes numbered/: a DCP of an optimizer's own state_dict saved as it is,

    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})

so the state is keyed by param number (`optimizer.state.0.exp_avg`, each group's `params` a list
of ints) beside the model's tensors in module order: two Linears around a BatchNorm1d (whose
running stats sit between params of the same shape), weights decayed and the rest not (two groups,
numbered group by group), the last bias never stepped (listed, no state). The reader names the
params after the model's tensors (tests/unit/test_dcp_layout.cpp); fuzz_dcp_numbered_checkpoint
takes this directory as its seed.

    .venv/bin/python formats/dcp/testdata/make_numbered.py
"""
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        model[2].bias.grad = None
        opt.step()
        opt.zero_grad()
    out = os.path.join(HERE, "numbered")
    shutil.rmtree(out, ignore_errors=True)
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=out)


if __name__ == "__main__":
    main()
