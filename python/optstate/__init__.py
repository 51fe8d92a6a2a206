"""optstate: fused and 8-bit AdamW with plain-tensor state, and tools for their checkpoints.

A thin Python face over the C++ library: the optimizer math and the checkpoint I/O run in the
torch ops library built from optim/ (see README.md).
"""
from ._ops import ops
from .optim import AdamW8bit, FusedAdamW
from .checkpoint import save, load, verify
from .notes import ReadNote
from .read import read_state_dict
from .sharded import ShardedParams

__all__ = ["AdamW8bit", "FusedAdamW", "ShardedParams", "save", "load", "verify", "read_state_dict", "ReadNote", "ops"]
__version__ = "0.1.0"
