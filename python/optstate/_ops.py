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
