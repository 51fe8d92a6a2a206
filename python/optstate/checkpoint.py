"""optstate.save / optstate.load: the native checkpoint, written and read by the C++ driver."""
import json

import torch

from ._ops import ops
from .optim import FusedAdamW

_HYPER = ("lr", "eps", "weight_decay", "amsgrad", "maximize")


def _kind(optimizer):
    if isinstance(optimizer, FusedAdamW):
        return "adamw"
    raise TypeError(f"optstate.save: unsupported optimizer {type(optimizer).__name__}")


def _check_single_process(what):
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise NotImplementedError(f"optstate.{what}: sharded (multi-rank) checkpoints are not in this build yet")


def _names(model, optimizer):
    by_id = {id(p): name for name, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError("optstate: the optimizer holds a parameter that is not in the model")
            out.append(by_id[id(p)])
    return out


def save(path, model, optimizer, overwrite=True):
    """Writes model weights and optimizer state as a native optstate checkpoint (atomically)."""
    _check_single_process("save")
    names = iter(_names(model, optimizer))
    meta = {"kind": _kind(optimizer), "param_groups": [], "params": {}}
    pnames, enames, tensors = [], [], []
    for gi, group in enumerate(optimizer.param_groups):
        g = {k: group[k] for k in _HYPER}
        g["lr"] = float(g["lr"])
        g["betas"] = [float(b) for b in group["betas"]]
        g["params"] = []
        for p in group["params"]:
            fqn = next(names)
            g["params"].append(fqn)
            state = optimizer.state.get(p, {})
            step = int(state["step"].item()) if "step" in state else 0
            meta["params"][fqn] = {"shape": list(p.shape), "dtype": str(p.dtype), "step": step, "group": gi}
            for entry in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if entry in state:
                    pnames.append(fqn)
                    enames.append(entry)
                    tensors.append(state[entry].detach())
            pnames.append(fqn)
            enames.append("param")
            tensors.append(p.detach())
        meta["param_groups"].append(g)
    ops.save_native(str(path), json.dumps(meta), pnames, enames, tensors, overwrite)


@torch.no_grad()
def load(path, model, optimizer):
    """Restores model weights and optimizer state from a native optstate checkpoint."""
    _check_single_process("load")
    meta_json, pnames, enames, tensors = ops.load_native(str(path))
    meta = json.loads(meta_json)
    if meta["kind"] != _kind(optimizer):
        raise ValueError(f"optstate.load: checkpoint holds '{meta['kind']}' state, optimizer is {_kind(optimizer)}")
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"optstate.load: checkpoint has {len(meta['param_groups'])} param groups, "
                         f"optimizer has {len(optimizer.param_groups)}")
    entries = {}
    for fqn, entry, t in zip(pnames, enames, tensors):
        entries.setdefault(fqn, {})[entry] = t
    names = iter(_names(model, optimizer))
    plan = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            fqn = next(names)
            if fqn not in meta["params"]:
                raise KeyError(f"optstate.load: {path} has no param '{fqn}'")
            pm = meta["params"][fqn]
            if list(p.shape) != pm["shape"]:
                raise ValueError(f"optstate.load: param '{fqn}' has shape {list(p.shape)}, checkpoint {pm['shape']}")
            plan.append((p, fqn, pm))
    for (p, fqn, pm) in plan:
        e = entries.get(fqn, {})
        if "param" in e:
            p.copy_(e["param"])
        optimizer.state.pop(p, None)
        if "exp_avg" in e:
            st = {"step": torch.tensor(float(pm["step"]), dtype=torch.float32),
                  "exp_avg": e["exp_avg"], "exp_avg_sq": e["exp_avg_sq"]}
            if "max_exp_avg_sq" in e:
                st["max_exp_avg_sq"] = e["max_exp_avg_sq"]
            optimizer.state[p] = st
    for group, gm in zip(optimizer.param_groups, meta["param_groups"]):
        for k in _HYPER:
            group[k] = gm[k]
        group["betas"] = tuple(gm["betas"])
