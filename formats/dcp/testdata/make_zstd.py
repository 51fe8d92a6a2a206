"""Writes zstd/: a DCP saved through torch's ZStandard extension,

    dcp.save(sd, storage_writer=FileSystemWriter(out, _extensions=[ZStandard()]))

each item's bytes (its torch.save archive) one zstd stream, its storage record's
transform_descriptors ["stream.zstd/1"]: get_state_dict's model and AdamW state (two Linears, one
step) beside a run's values ("extra": a list and a number), which DCP -> DCP carries as stored.
tests/unit/test_dcp_layout.cpp reads it; fuzz_dcp_zstd_checkpoint takes it as its seed (the input
replaces __0_0.distcp: the zstd streams themselves). Needs the zstandard (or pyzstd) package.

    .venv/bin/python formats/dcp/testdata/make_zstd.py
"""
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.state_dict import get_state_dict

HERE = os.path.dirname(os.path.abspath(__file__))


def stepped_state():
    """get_state_dict's model and AdamW state of two Linears after one step (make_safetensors.py too)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    return get_state_dict(model, opt)


def main():
    msd, osd = stepped_state()
    out = os.path.join(HERE, "zstd")
    shutil.rmtree(out, ignore_errors=True)
    sd = {"model": msd, "optim": osd, "extra": {"history": [0.5, 0.25, 0.125], "step": 1}}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(out, _extensions=[ZStandard()]))


if __name__ == "__main__":
    main()
