"""Loads the optstate torch ops library (built by CMake into build/)."""
import os
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parents[2]


def _library_path() -> Path:
    env = os.environ.get("OPTSTATE_OPS_LIBRARY")
    if env:
        return Path(env)
    return _REPO / "build" / "liboptstate_ops.so"


def load() -> None:
    if hasattr(torch.ops, "optstate") and hasattr(torch.ops.optstate, "fused_adamw_"):
        return
    path = _library_path()
    if not path.exists():
        raise ImportError(
            f"optstate: the ops library {path} is missing; run scripts/setup.sh (or set OPTSTATE_OPS_LIBRARY)"
        )
    torch.ops.load_library(str(path))


load()
ops = torch.ops.optstate


def open_checkpoint(path):
    """The checkpoint at ``path``, opened once (its metadata parsed) for several reads: an object
    with the methods load_native_shard, check_native_shard, verify_native_shard, load_model_tensors
    and verify_model_tensors, which take the arguments of the ops of those names less the path.
    Raises RuntimeError naming the file when it cannot be read as a checkpoint."""
    return torch.classes.optstate.Checkpoint(str(path))
