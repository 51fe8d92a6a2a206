"""optstate.read_state_dict: any checkpoint optstate reads, as PyTorch's own state dicts in memory.

The C++ drivers read the checkpoint (optstate's, a DCP, a torch.save file, DeepSpeed's, Megatron's,
nanotron's, ...: whatever `optstate inspect` takes); this only arranges the tensors they return in
the form torch's optimizer and torch.distributed.checkpoint.state_dict take. No torchao, DeepSpeed
or Megatron is needed to read their state, and 8-bit moments come back dequantized (fp32), as
torch.optim.AdamW keeps them.
"""
import json

import torch

from ._gc import gc_paused
from ._ops import open_checkpoint
from .notes import warn_read_notes

# Dense fp32 moments whatever the checkpoint holds; the two numbers are the 8-bit layout's, unused here.
_TO, _BLOCK, _MIN_8BIT = "fp32", 256, 4096


def _group_defaults():
    """The keys torch.optim.AdamW puts in a param group besides the canonical ones (foreach, fused,
    capturable, ..., as this torch release names them), at their defaults."""
    group = torch.optim.AdamW([torch.zeros(1)]).param_groups[0]
    return {k: v for k, v in group.items() if k not in ("params", "lr", "betas", "eps", "weight_decay", "amsgrad",
                                                         "maximize")}


@gc_paused
def read_state_dict(path):
    """Reads the checkpoint at ``path`` and returns ``(model_state_dict, optim_state_dict)``, as
    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` gives them, so that
    ``set_state_dict(model, optimizer, model_state_dict=..., optim_state_dict=...)`` (or
    ``model.load_state_dict`` and ``set_optimizer_state_dict``) takes them for a plain
    ``torch.optim.AdamW``:

    - ``optim_state_dict``: ``{"state": {fqn: {"step": float32 0-d tensor, "exp_avg": ...,
      "exp_avg_sq": ...[, "max_exp_avg_sq": ...]}}, "param_groups": [{"lr", "betas", "eps",
      "weight_decay", "amsgrad", "maximize", torch.optim.AdamW's other keys at their defaults,
      "params": [fqn, ...]}]}``; moments fp32 (8-bit ones dequantized), whole (a sharded checkpoint
      of any number of ranks is put together). A checkpoint whose params are numbered (an optimizer
      built without names, as ``optimizer.pt`` of Hugging Face's Trainer) keeps the numbers as
      ints: torch's own ``optimizer.state_dict()`` form, which ``optimizer.load_state_dict`` takes.
      A param that was never stepped has no state, as in torch's.
    - ``model_state_dict``: the weights the checkpoint holds (its params' weights, fp32 masters
      where it kept them, in their stored dtype; a torch.save file's or a DCP's buffers and frozen
      params), by name; empty for a checkpoint of the optimizer alone.

    What the canonical state does not carry is not returned: a group's other keys (an LR
    scheduler's ``initial_lr``), and the source's own ``fused``/``foreach``/``capturable`` switches,
    which come back at torch's defaults. A checkpoint optstate cannot read raises ``RuntimeError``
    naming the file and what is wrong, as ``optstate inspect`` reports it. What ``optstate inspect``
    notes of the read (a save folder read at the save its tracker names, values read as the file does
    not say them) comes as ``optstate.ReadNote`` warnings.
    """
    ck = open_checkpoint(path)  # once for both reads below: opening parses all the metadata
    meta_json, pnames, enames, cnames, tensors = ck.load_native_shard(_TO, _BLOCK, _MIN_8BIT, 1, 0, False,
                                                                      [], [], [], [])
    meta = json.loads(meta_json)
    numbered = bool(meta["params"]) and all(n.isdigit() for n in meta["params"])
    key = int if numbered else str

    values = {}
    for p, e, c, t in zip(pnames, enames, cnames, tensors):
        if c != "values":  # with _TO "fp32" every moment is dense; an 8-bit part here would be a bug
            raise RuntimeError(f"optstate.read_state_dict: {path}: param '{p}' entry '{e}' came back as {c}")
        values.setdefault(p, {})[e] = t

    state, weights = {}, {}
    for fqn, pm in meta["params"].items():
        entries = values.get(fqn, {})
        if "param" in entries:
            weights[fqn] = entries["param"]
        moments = {e: t for e, t in entries.items() if e != "param"}
        if moments:
            state[key(fqn)] = {"step": torch.tensor(float(pm["step"]), dtype=torch.float32), **moments}

    defaults = _group_defaults()
    groups = []
    for g in meta["param_groups"]:
        beta1, beta2 = g["betas"]
        groups.append({"lr": g["lr"], "betas": (beta1, beta2), "eps": g["eps"], "weight_decay": g["weight_decay"],
                       "amsgrad": g["amsgrad"], "maximize": g["maximize"], **defaults,
                       "params": [key(n) for n in g["params"]]})
    names, others = ck.load_model_tensors("load", [], [])
    for name, t in zip(names, others):
        weights.setdefault(name, t)
    warn_read_notes(ck, path)
    return weights, {"state": state, "param_groups": groups}
