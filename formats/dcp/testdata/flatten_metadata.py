"""Rewrites a DCP's .metadata from get_state_dict's nested layout ({"model", "optim"}) into the
layout torchtitan saves (or, with `--layout prime-rl`, prime-rl's: below): weights at the top level, the optimizer flattened under "optimizer"
(flatten_optimizer_state_dict=True: per-param param_groups fields). Storage locations are kept,
so the result describes the same data files; each param's group fields point at its group's
items. Items the canonical state does not hold are added the same way (an LR scheduler's
`initial_lr` in the groups, `lr_scheduler.*` with a list index in its path, one a 0-d tensor,
`train_state.step`),
so a DCP -> DCP write carries them. Makes the fuzz seed checkpoint/flattened.metadata from the
fixture's checkpoint:

    .venv/bin/python formats/dcp/testdata/flatten_metadata.py DCP_DIR OUT

prime-rl saves its trainer as dcp.save({"app": AppState}): the same nested layout one level down
(`app.model.<fqn>`, `app.optimizers.state.<fqn>.<entry>`, `app.optimizers.param_groups.<i>.<field>`)
beside `app.scheduler.*` and `app.progress.*`. Makes checkpoint/prime_rl.metadata:

    .venv/bin/python formats/dcp/testdata/flatten_metadata.py DCP_DIR OUT --layout prime-rl
"""
import io
import pickle
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex


def main(src, out, *layout):
    src = Path(src)
    md: Metadata = pickle.loads((src / ".metadata").read_bytes())
    storage = md.storage_data

    def item_bytes(key):
        info = storage[MetadataIndex(key)]
        with open(src / info.relative_path, "rb") as f:
            f.seek(info.offset)
            return f.read(info.length)

    members = {}  # group index -> fqns
    for key in md.state_dict_metadata:
        path = md.planner_data[key]
        if path[:2] == ("optim", "param_groups") and path[3] == "params":
            members[path[2]] = torch.load(io.BytesIO(item_bytes(key)), weights_only=True)
    new_items, new_planner, new_storage = {}, {}, {}

    def put(old_key, new_key, new_path):
        new_items[new_key] = md.state_dict_metadata[old_key]
        new_planner[new_key] = new_path
        for idx, info in storage.items():
            if idx.fqn == old_key:
                new_storage[MetadataIndex(new_key, idx.offset, idx.index)] = info

    if layout == ("--layout", "prime-rl"):
        for key in md.state_dict_metadata:
            path = md.planner_data[key]
            top = {"model": "model", "optim": "optimizers"}[path[0]]
            new_path = ("app", top) + tuple(path[1:])
            put(key, ".".join(map(str, new_path)), new_path)
            if path[:2] == ("optim", "state") and path[3] == "step" and "app.progress.step" not in new_items:
                put(key, "app.progress.step", ("app", "progress", "step"))
                put(key, "app.scheduler._last_lr.0", ("app", "scheduler", "_last_lr", 0))
            if path[:2] == ("optim", "param_groups") and path[3] == "lr" and "app.scheduler.base_lrs.0" not in new_items:
                put(key, "app.scheduler.base_lrs.0", ("app", "scheduler", "base_lrs", 0))
                put(key, "app.scheduler.last_epoch", ("app", "scheduler", "last_epoch"))
        out_md = Metadata(state_dict_metadata=new_items, planner_data=new_planner, storage_data=new_storage)
        Path(out).write_bytes(pickle.dumps(out_md, protocol=2))
        return
    elif layout:
        sys.exit(f"unknown arguments {layout}: --layout prime-rl, or none for torchtitan's")
    for key in md.state_dict_metadata:
        path = md.planner_data[key]
        if path[0] == "model":
            put(key, path[1], (path[1],))
        elif path[:2] == ("optim", "state"):
            flat = f"state.{path[2]}.{path[3]}"
            put(key, "optimizer." + flat, ("optimizer", flat))
            if path[3] == "step" and "train_state.step" not in new_items:
                put(key, "train_state.step", ("train_state", "step"))
                # a 0-d float32 tensor, as torchao's LR scheduler keeps its lrs (convert --float-lr)
                put(key, "lr_scheduler._last_lr.0", ("lr_scheduler", "_last_lr", 0))
        elif path[:2] == ("optim", "param_groups") and path[3] != "params":
            for fqn in members[path[2]]:
                flat = f"param_groups.{fqn}.{path[3]}"
                put(key, "optimizer." + flat, ("optimizer", flat))
                if path[3] == "lr":
                    put(key, f"optimizer.param_groups.{fqn}.initial_lr", ("optimizer", f"param_groups.{fqn}.initial_lr"))
            if path[3] == "lr":
                put(key, "lr_scheduler.base_lrs.0", ("lr_scheduler", "base_lrs", 0))
                put(key, "lr_scheduler.last_epoch", ("lr_scheduler", "last_epoch"))
    out_md = Metadata(state_dict_metadata=new_items, planner_data=new_planner, storage_data=new_storage)
    Path(out).write_bytes(pickle.dumps(out_md, protocol=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
