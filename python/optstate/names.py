"""Parameter names as torch's distributed state dicts write them (get_model_state_dict,
get_state_dict, and so DCP): the segments that wrappers insert into ``named_parameters()`` are
dropped, so a checkpoint's names do not depend on how the model was wrapped, and match a DCP of
the same model (DESIGN §1: state keyed by fully qualified name).
"""
from torch.nn.parallel import DistributedDataParallel

# torch.compile's OptimizedModule, activation checkpointing's CheckpointWrapper, FSDP1's wrapper.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical_name(model, name):
    parts = name.split(".")
    if isinstance(model, DistributedDataParallel) and parts[0] == "module":
        parts = parts[1:]  # DDP's own prefix, as torch drops it
    return ".".join(p for p in parts if p not in _WRAPPER_SEGMENTS)


def named_parameters(model):
    """``model.named_parameters()`` under canonical names; two params that would share a name are an
    error (a model that wraps a module twice over one name is not one state)."""
    out, seen = [], {}
    for name, p in model.named_parameters():
        fqn = canonical_name(model, name)
        if fqn in seen:
            raise ValueError(f"optstate: parameters '{seen[fqn]}' and '{name}' both have the name '{fqn}'")
        seen[fqn] = name
        out.append((fqn, p))
    return out
