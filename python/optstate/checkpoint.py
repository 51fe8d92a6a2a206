"""optstate.save / optstate.load: the native checkpoint, written and read by the C++ driver."""
import json

import torch

from ._ops import ops
from .optim import AdamW8bit, FusedAdamW

_HYPER = ("lr", "eps", "weight_decay", "amsgrad")
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _kind(optimizer):
    if isinstance(optimizer, FusedAdamW):
        return "adamw"
    if isinstance(optimizer, AdamW8bit):
        return "adamw8bit"
    raise TypeError(f"optstate: unsupported optimizer {type(optimizer).__name__}")


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


def save(path, model, optimizer, overwrite=True, dequantize=False):
    """Writes model weights and optimizer state as a native optstate checkpoint (atomically).

    8-bit state is stored as codes + absmax + map name; ``dequantize=True`` stores it as dense fp32.
    """
    _check_single_process("save")
    names = iter(_names(model, optimizer))
    meta = {"kind": _kind(optimizer), "param_groups": [], "params": {}}
    lists = ([], [], [], [])  # fqn, entry, component, tensor

    def add(fqn, entry, component, tensor):
        for lst, v in zip(lists, (fqn, entry, component, tensor.detach())):
            lst.append(v)

    for gi, group in enumerate(optimizer.param_groups):
        g = {k: group[k] for k in _HYPER}
        g["lr"] = float(g["lr"])
        g["maximize"] = bool(group.get("maximize", False))
        g["betas"] = [float(b) for b in group["betas"]]
        g["params"] = []
        for p in group["params"]:
            fqn = next(names)
            g["params"].append(fqn)
            state = optimizer.state.get(p, {})
            step = int(state["step"].item()) if "step" in state else 0
            pm = {"shape": list(p.shape), "dtype": str(p.dtype), "step": step, "group": gi, "entries": {}}
            for entry in _MOMENTS:
                if entry + "_codes" in state:
                    qmap = group["exp_avg_qmap"] if entry == "exp_avg" else group["exp_avg_sq_qmap"]
                    pm["entries"][entry] = {"encoding": "blockwise8", "block_size": group["block_size"],
                                            "qmap": qmap}
                    add(fqn, entry, "codes", state[entry + "_codes"])
                    add(fqn, entry, "absmax", state[entry + "_absmax"])
                elif entry in state:
                    add(fqn, entry, "values", state[entry])
            add(fqn, "param", "values", p)
            meta["params"][fqn] = pm
        meta["param_groups"].append(g)
    ops.save_native(str(path), json.dumps(meta), *lists, overwrite, dequantize)


@torch.no_grad()
def load(path, model, optimizer):
    """Restores model weights and optimizer state from a native optstate checkpoint.

    Entries are converted to what the optimizer keeps: FusedAdamW gets dense fp32 moments;
    AdamW8bit gets 8-bit moments for params of at least min_8bit_size elements (an 8-bit checkpoint
    saved with dequantize=True comes back with its original codes).
    """
    _check_single_process("load")
    if isinstance(optimizer, AdamW8bit):
        group = optimizer.param_groups[0]
        if any(g["block_size"] != group["block_size"] or g["min_8bit_size"] != group["min_8bit_size"]
               for g in optimizer.param_groups):
            raise ValueError("optstate.load: AdamW8bit param groups must share block_size and min_8bit_size")
        target = ("8bit", group["block_size"], group["min_8bit_size"])
    else:
        _kind(optimizer)
        target = ("fp32", 0, 0)
    meta_json, pnames, enames, cnames, tensors = ops.load_native(str(path), *target)
    meta = json.loads(meta_json)
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"optstate.load: {path} has {len(meta['param_groups'])} param groups, "
                         f"the optimizer has {len(optimizer.param_groups)}")
    found = {}
    for fqn, entry, comp, t in zip(pnames, enames, cnames, tensors):
        found.setdefault(fqn, {})[(entry, comp)] = t
    names = iter(_names(model, optimizer))
    plan = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = next(names)
            if fqn not in meta["params"]:
                raise KeyError(f"optstate.load: {path} has no param '{fqn}'")
            pm = meta["params"][fqn]
            if list(p.shape) != pm["shape"]:
                raise ValueError(f"optstate.load: param '{fqn}' has shape {list(p.shape)}, checkpoint {pm['shape']}")
            plan.append((p, fqn, pm))
    for p, fqn, pm in plan:
        e = found.get(fqn, {})
        if ("param", "values") in e:
            p.copy_(e[("param", "values")])
        optimizer.state.pop(p, None)
        if not any(k[0] == "exp_avg" for k in e):
            continue
        st = {"step": torch.tensor(float(pm["step"]), dtype=torch.float32)}
        for entry in _MOMENTS:
            if (entry, "codes") in e:
                st[entry + "_codes"] = e[(entry, "codes")]
                st[entry + "_absmax"] = e[(entry, "absmax")]
            elif (entry, "values") in e:
                st[entry] = e[(entry, "values")]
        optimizer.state[p] = st
    for group, gm in zip(optimizer.param_groups, meta["param_groups"]):
        for k in _HYPER:
            group[k] = gm[k]
        if "maximize" in group:
            group["maximize"] = gm["maximize"]
        group["betas"] = tuple(gm["betas"])
