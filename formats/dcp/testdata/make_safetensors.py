"""Writes safetensors/: a DCP saved with torch's safetensors serialization,

    dcp.save(sd, storage_writer=FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS))

each rank's bytes items as usual, then its tensors in one safetensors blob placed by
`__metadata__["DCP_SHARDING_INFO"]`, every tensor chunk's offset in the .metadata the blob's start
(torch's own reader cannot load it back; optstate reads the blob: hf_storage.h):
get_state_dict's model and AdamW state (two Linears, one step: make_zstd.py's). fuzz_dcp_safetensors_checkpoint
takes it as its seed (the input replaces __0_0.distcp: the bytes items and the blob).

    .venv/bin/python formats/dcp/testdata/make_safetensors.py
"""
import os
import shutil

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import SerializationFormat

from make_zstd import HERE, stepped_state


def main():
    msd, osd = stepped_state()
    out = os.path.join(HERE, "safetensors")
    shutil.rmtree(out, ignore_errors=True)
    writer = dcp.FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer, no_dist=True)


if __name__ == "__main__":
    main()
