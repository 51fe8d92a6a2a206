"""optstate.save / optstate.load / optstate.verify: the native checkpoint, written and read by the C++
driver, from one process or from every rank of a torch.distributed process group (DESIGN §6).

Layouts:
- a plain model on one process: the whole state;
- a plain model under a process group (DDP: every rank holds the whole, identical state): every rank
  writes its shard of each entry in parallel, rank 0 commits; every rank loads the whole state;
- ``ShardedParams`` (ZeRO-1): every rank writes and loads only its own ranges, on any number of ranks;
- FSDP2 (``fully_shard``: DTensor params and moments sharded by rows of dim 0 over all ranks, as
  torch.chunk splits them): the same layout as optstate's dense shards, and as its 8-bit shards
  where every rank's rows begin on a block (which AdamW8bit requires under FSDP2), so each rank
  writes and loads its local rows as they are;
- HSDP (``fully_shard`` on a 2-d (replicate, shard) mesh: placements (Replicate(), Shard(0))): the
  checkpoint of S shard ranks, written by the first replica's S ranks; every replica loads its rows.
"""
import json
import os

import torch
import torch.distributed as dist

from ._gc import gc_paused
from ._ops import open_checkpoint, ops
from .notes import warn_read_notes
from .optim import AdamW8bit, DTensor, FusedAdamW, _check_fsdp2_blocks, _fsdp2_absmax, _rows_layout
from .names import canonical_name, named_parameters
from .sharded import ShardedParams, world_and_rank

_HYPER = ("lr", "eps", "weight_decay", "amsgrad")
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _kind(optimizer):
    if isinstance(optimizer, FusedAdamW):
        return "adamw"
    if isinstance(optimizer, AdamW8bit):
        return "adamw8bit"
    raise TypeError(f"optstate: unsupported optimizer {type(optimizer).__name__}")


def _is_dtensor(t):
    return isinstance(t, DTensor)  # () without torch.distributed: never


def _rows_rank(t, fqn, what):
    """(shard ranks S, this rank's index s among them, whether it writes) for a DTensor laid out as
    optstate's dense shards: Shard(0) over one dim of a mesh of every rank, Replicate over the others
    (FSDP2's fully_shard; HSDP), each rank holding the rows torch.chunk gives index s of S. The
    replicas of a row range hold the same values; the one whose other mesh coordinates are all 0
    writes it. Any other layout (TP, a sub-mesh) is refused, naming the param."""
    mesh = t.device_mesh
    world, _ = world_and_rank()
    layout = _rows_layout(t)
    coordinate = mesh.get_coordinate()
    if layout is None or mesh.size() != world or coordinate is None:
        raise NotImplementedError(
            f"optstate: {what} of '{fqn}' is a DTensor with placements {tuple(t.placements)} on a mesh of shape "
            f"{tuple(mesh.shape)}; optstate.save/load handle FSDP2's row sharding over all ranks (Shard(0) on a "
            f"1-D mesh, or HSDP's (Replicate(), Shard(0))) only. Save other layouts with "
            f"torch.distributed.checkpoint: optstate reads a DCP of any number of ranks")
    dim, shards = layout
    index = coordinate[dim]
    begin, end = ops.shard_range(list(t.shape), 0, shards, index)
    local = t.to_local()
    if local.numel() != end - begin:
        raise NotImplementedError(f"optstate: {what} of '{fqn}': shard {index} of {shards} holds {local.numel()} "
                                  f"elements, the torch.chunk rows of {list(t.shape)} over {shards} ranks are "
                                  f"{end - begin}")
    return shards, index, all(c == 0 for d, c in enumerate(coordinate) if d != dim)


def _local_rows(t, fqn, what):
    """The local rows of a DTensor of FSDP2's layout (_rows_rank), checked."""
    _rows_rank(t, fqn, what)
    return t.to_local()


def _rows_group(model, optimizer):
    """(S, s, writes) shared by every DTensor param of an FSDP2/HSDP model: save and load treat the
    checkpoint as written by S ranks, of which this one is s. Params sharded over different meshes
    are refused."""
    found = {}
    for _, _, fqn, whole in _params(model, optimizer):
        if _is_dtensor(whole):
            found.setdefault(_rows_rank(whole, fqn, "the parameter"), fqn)
    if not found:
        return (*world_and_rank(), True)
    if len(found) > 1:
        (a, fa), (b, fb) = list(found.items())[:2]
        raise NotImplementedError(f"optstate: '{fa}' is shard {a[1]} of {a[0]} and '{fb}' shard {b[1]} of {b[0]} "
                                  f"on this rank; optstate.save/load need every param sharded over the same "
                                  f"ranks. Save with torch.distributed.checkpoint instead")
    return next(iter(found))


def _row_sharded(model):
    """True for a model with FSDP2 (DTensor) params: each rank saves and loads its local rows."""
    return not isinstance(model, ShardedParams) and any(_is_dtensor(p) for p in model.parameters())


def _params(model, optimizer, by_position=False):
    """(group index, optimizer tensor, fqn, whole param) for every param of the optimizer, in order.
    With ``by_position`` the name is the param's number in group order ("0", "1", ...), which is how
    torch numbers an optimizer's params in its state_dict."""
    if isinstance(model, ShardedParams):
        lookup = {id(s.local): (s.fqn, s.param) for s in model.shards}
    else:
        lookup = {id(p): (name, p) for name, p in named_parameters(model)}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in lookup:
                raise ValueError("optstate: the optimizer holds a parameter that is not in the model"
                                 + (" (pass ShardedParams.parameters() to the optimizer)"
                                    if isinstance(model, ShardedParams) else ""))
            fqn, whole = lookup[id(p)]
            if _is_dtensor(whole):
                _local_rows(whole, fqn, "the parameter")
                if isinstance(optimizer, AdamW8bit) and whole.numel() >= optimizer.param_groups[gi]["min_8bit_size"]:
                    _check_fsdp2_blocks(whole, optimizer.param_groups[gi]["block_size"])
            out.append((gi, p, fqn, whole))
    return [(gi, p, str(i), whole) for i, (gi, p, _, whole) in enumerate(out)] if by_position else out


def _store_address(group):
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if not hasattr(store, "port"):
        raise RuntimeError(f"optstate: sharded save needs the process group's store to be a TCPStore "
                           f"(init_method env:// or tcp://, as torchrun sets up); it is {type(store).__name__}")
    return store.host, store.port


class _Lists:
    def __init__(self):
        self.fqn, self.entry, self.comp, self.tensor = [], [], [], []

    def add(self, fqn, entry, comp, t):
        self.fqn.append(fqn)
        self.entry.append(entry)
        self.comp.append(comp)
        self.tensor.append(t.detach().contiguous())

    def args(self):
        return self.fqn, self.entry, self.comp, self.tensor


def _state_lists(model, optimizer, slice_world, slice_rank, whole_param, by_position=False):
    """The optimizer's state as (meta json, lists). Moments of a ShardedParams are its ranges as
    they are; whole tensors are cut to rank `slice_rank` of `slice_world` (1: kept whole). The
    weights are cut the same way unless `whole_param`. With `by_position`, params are named by
    their number in group order (see _params)."""
    sharded = isinstance(model, ShardedParams)
    meta = {"kind": _kind(optimizer), "param_groups": [dict(params=[]) for _ in optimizer.param_groups],
            "params": {}}
    lists = _Lists()

    def cut(t, block, comp, shape):
        if slice_world == 1:
            return t
        b, e = ops.shard_range(list(shape), block, slice_world, slice_rank)
        if comp == "absmax":
            b, e = b // block, -(-e // block)
        return t.reshape(-1)[b:e]

    for gi, group in enumerate(optimizer.param_groups):
        g = meta["param_groups"][gi]
        g.update({k: group[k] for k in _HYPER})
        g["lr"] = float(g["lr"])
        g["maximize"] = bool(group.get("maximize", False))
        g["betas"] = [float(b) for b in group["betas"]]
    for gi, p, fqn, whole in _params(model, optimizer, by_position):
        meta["param_groups"][gi]["params"].append(fqn)
        state = optimizer.state.get(p, {})
        step = int(state["step"].item()) if "step" in state else 0
        pm = {"shape": list(whole.shape), "dtype": str(whole.dtype), "step": step, "group": gi, "entries": {}}
        shape = whole.shape
        for entry in _MOMENTS:
            group = optimizer.param_groups[gi]
            if entry + "_codes" in state:
                block = group["block_size"]
                qmap = group["exp_avg_qmap"] if entry == "exp_avg" else group["exp_avg_sq_qmap"]
                pm["entries"][entry] = {"encoding": "blockwise8", "block_size": block, "qmap": qmap}
                codes, absmax = state[entry + "_codes"], state[entry + "_absmax"]
                if _is_dtensor(codes):  # FSDP2: the local rows, on blocks, are this rank's range
                    lists.add(fqn, entry, "codes", _local_rows(codes, fqn, entry + "_codes"))
                    lists.add(fqn, entry, "absmax", _local_rows(absmax, fqn, entry + "_absmax").reshape(-1))
                    continue
                if sharded and codes.numel() == whole.numel():
                    codes = codes.reshape(shape)
                lists.add(fqn, entry, "codes", codes if sharded else cut(codes, block, "codes", shape))
                lists.add(fqn, entry, "absmax", absmax if sharded else cut(absmax, block, "absmax", shape))
            elif entry in state:
                values = state[entry]
                if _is_dtensor(values):  # FSDP2: the local rows are this rank's range as it is
                    lists.add(fqn, entry, "values", _local_rows(values, fqn, entry))
                    continue
                if sharded and values.numel() == whole.numel():
                    values = values.reshape(shape)
                lists.add(fqn, entry, "values", values if sharded else cut(values, 0, "values", shape))
        if _is_dtensor(whole):
            lists.add(fqn, "param", "values", _local_rows(whole, fqn, "the parameter"))
        else:
            lists.add(fqn, "param", "values", whole if whole_param else cut(whole, 0, "values", shape))
        meta["params"][fqn] = pm
    return json.dumps(meta), lists


@gc_paused
def save(path, model, optimizer, overwrite=True, dequantize=False, timeout=600.0):
    """Writes model weights and optimizer state as a native optstate checkpoint, atomically.

    ``model`` is the ``nn.Module`` (also one sharded by FSDP2's ``fully_shard``: each rank writes its
    rows) or, for a ZeRO-1 sharded optimizer, its ``ShardedParams``. Under
    an initialized process group every rank must call this: each writes its own file in parallel and
    rank 0 commits after all have reported (a failed or silent rank: no commit, the previous
    checkpoint stays). 8-bit state is stored as codes + absmax + map name; ``dequantize=True``
    (single process) stores it as dense fp32. ``overwrite`` replaces an existing checkpoint (of any
    format) or an empty directory; a path holding anything else is refused and left as it is.
    """
    group = model.group if isinstance(model, ShardedParams) else None
    world, rank = world_and_rank(group)
    if isinstance(model, ShardedParams) and (model.world, model.rank) != (world, rank):
        raise RuntimeError("optstate.save: the process group changed since ShardedParams was made")
    if world == 1:
        meta, lists = _state_lists(model, optimizer, 1, 0, whole_param=True)
        ops.save_native(str(path), meta, *lists.args(), overwrite, dequantize)
        return
    if dequantize:
        raise ValueError("optstate.save: dequantize=True is for single-process saves; convert a sharded "
                         "checkpoint afterwards with `optstate convert SRC DST --to fp32`")
    save_id = _next_save_id(path)  # every rank calls save, so every rank counts alike
    shards, index, writes = _rows_group(model, optimizer) if _row_sharded(model) else (world, rank, True)
    if shards == world:  # every rank writes its part (FSDP2, ZeRO-1, a replicated model)
        # (as shard `index`, the mesh coordinate its rows belong to, which need not be its rank)
        meta, lists = _state_lists(model, optimizer, shards, index, whole_param=False)
        host, port = _store_address(group)
        ops.save_native_sharded(str(path), meta, *lists.args(), overwrite, host, port, shards, index, save_id,
                                float(timeout))
        return
    # HSDP: the first replica of every row range writes it, as S ranks would; the other replicas
    # hold the same values and only learn, with everyone, whether every writer succeeded.
    err = None
    if writes:
        try:
            meta, lists = _state_lists(model, optimizer, shards, index, whole_param=False)
            host, port = _store_address(group)
            ops.save_native_sharded(str(path), meta, *lists.args(), overwrite, host, port, shards, index,
                                    save_id, float(timeout))
        except Exception as e:  # noqa: BLE001 - raised below, after every rank has had its say
            err = e
    _all_ranks_ok(group, err, f"optstate.save: a writing rank failed to save {path} (its error is in its log)")


_save_counts = {}


def _next_save_id(path):
    """The store key prefix of this process's n-th sharded save to `path`: the same on every rank,
    whichever ranks write, and never one an earlier save used."""
    key = os.path.abspath(str(path))
    n = _save_counts.get(key, 0)
    _save_counts[key] = n + 1
    return f"py:{key}#{n}"


def _target(optimizer):
    if isinstance(optimizer, AdamW8bit):
        group = optimizer.param_groups[0]
        if any(g["block_size"] != group["block_size"] or g["min_8bit_size"] != group["min_8bit_size"]
               for g in optimizer.param_groups):
            raise ValueError("optstate: AdamW8bit param groups must share block_size and min_8bit_size")
        return "8bit", group["block_size"], group["min_8bit_size"]
    _kind(optimizer)
    return "fp32", 0, 0


def _load_plan(path, meta, params, optimizer, by_position=False):
    """The checks a load makes on a checkpoint's metadata before it changes anything live: one entry
    (param, fqn, whole, param meta) per optimized param (``params``: _params' list) and each live
    group's hyperparameters, or an error naming the file and param."""
    plan = []
    if by_position:
        # As torch's load_state_dict: the same groups, param i of the file in the group of param i.
        if len(meta["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"optstate.load: {path} has {len(meta['param_groups'])} param groups, the optimizer "
                             f"{len(optimizer.param_groups)}; by_position matches them group by group")
        extra = [n for n in meta["params"] if not n.isdigit() or int(n) >= len(params)]
        if extra:
            raise ValueError(f"optstate.load: {path} has param '{extra[0]}', which is no position among the "
                             f"optimizer's {len(params)} params")
        for gi, _, fqn, _ in params:
            if fqn in meta["params"] and meta["params"][fqn]["group"] != gi:
                raise ValueError(f"optstate.load: param {fqn} is in param group {meta['params'][fqn]['group']} "
                                 f"of {path} and in group {gi} of the optimizer")
    for _, p, fqn, whole in params:
        if fqn not in meta["params"]:
            if by_position:
                continue  # never stepped when saved: torch keeps no state for it either
            names = meta["params"].keys()
            if names and all(n.isdigit() for n in names):
                raise KeyError(f"optstate.load: {path} has no param '{fqn}': its params are numbered (0..), as "
                               f"an optimizer built without names keeps them (torch.save or dcp.save of its "
                               f"state_dict); pass by_position=True to "
                               f"match them by position, as torch's optimizer.load_state_dict does")
            raise KeyError(f"optstate.load: {path} has no param '{fqn}'")
        pm = meta["params"][fqn]
        if list(whole.shape) != pm["shape"]:
            raise ValueError(f"optstate.load: param '{fqn}' has shape {list(whole.shape)}, checkpoint {pm['shape']}")
        plan.append((p, fqn, whole, pm))
    return plan, _group_hypers(path, meta, params, optimizer)


def _group_hypers(path, meta, params, optimizer):
    """The checkpoint's hyperparameters for each live param group, found through its params (groups
    are matched by membership, not by position: a flattened DCP, torchtitan's, records no group
    order); None for a group without params. A live group whose params the checkpoint has with
    different hyperparameters is an error."""
    found = [{} for _ in optimizer.param_groups]  # per live group: hyperparameters -> (first fqn, group meta)
    for gi, _, fqn, _ in params:
        if fqn not in meta["params"]:
            continue
        gm = meta["param_groups"][meta["params"][fqn]["group"]]
        found[gi].setdefault(tuple((k, repr(gm.get(k))) for k in _HYPER + ("betas", "maximize")), (fqn, gm))
    for gi, f in enumerate(found):
        if len(f) > 1:
            (a, ga), (b, gb) = list(f.values())[:2]
            raise ValueError(f"optstate.load: param group {gi} holds '{a}' and '{b}', which {path} has with "
                             f"different hyperparameters (lr {ga['lr']} vs {gb['lr']}, weight_decay "
                             f"{ga['weight_decay']} vs {gb['weight_decay']}, ...); split the group as it was")
    return [next(iter(f.values()))[1] if f else None for f in found]


def _all_ranks_ok(group, err, failed_elsewhere):
    """One collective: every rank learns whether all ranks passed their check. Raises on every rank
    if any failed: its own error on the failing ones, RuntimeError(failed_elsewhere) on the others."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    ok = torch.tensor([0 if err is not None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if err is not None:
        raise err
    if ok.item() == 0:
        raise RuntimeError(failed_elsewhere)


def _model_targets(path, ck, model, optimizer, mode):
    """The model's tensors that the checkpoint's other tensors go into (a torch.save file's or a
    DCP's buffers, such as BatchNorm's running stats; frozen params' weights), by name, shapes
    checked before anything changes (as torch's load_state_dict checks them; the copy casts).
    ``mode`` "check" reads and checks every byte of them first (the transactional pass), "meta"
    only their metadata. A name the model does not hold (a buffer it keeps non-persistent) is
    passed over, so is the optimizer's params' (their weights are the state's: a tied weight's
    second name is one of them), and a DTensor (FSDP2 shards frozen params: left as they are)."""
    if isinstance(model, ShardedParams):
        return {}
    names, metas = ck.load_model_tensors(mode, [], [])
    if not names:
        return {}
    return {name: live for name, (live, _) in _model_pairs(path, model, optimizer, names, metas).items()}


def _model_pairs(path, model, optimizer, names, metas):
    """_model_targets' pairing: {name: (live tensor, the checkpoint's meta tensor)}."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    live = {}
    for name, t in model.state_dict(keep_vars=True).items():
        live.setdefault(canonical_name(model, name), t)
    targets = {}
    for name, meta in zip(names, metas):
        t = live.get(name)
        if t is None or id(t) in stepped or _is_dtensor(t):
            continue
        if t.shape != meta.shape:
            raise ValueError(f"optstate.load: {path} holds the model's '{name}' of shape {list(meta.shape)}; the "
                             f"model's is {list(t.shape)}")
        targets[name] = (t, meta)
    return targets


def _load_model_tensors(ck, targets):
    """Reads the checkpoint's other tensors into their targets: in place where a target is a
    contiguous CPU tensor of the same dtype (a live buffer: nothing allocated), else copied."""
    if not targets:
        return
    names, tensors = ck.load_model_tensors("load", list(targets), [t.detach() for t in targets.values()])
    for name, t in zip(names, tensors):
        live = targets.get(name)
        if live is not None and t.data_ptr() != live.data_ptr():
            live.copy_(t)


@torch.no_grad()
@gc_paused
def load(path, model, optimizer, transactional=True, by_position=False):
    """Restores model weights and optimizer state from a native optstate checkpoint.

    Entries are converted to what the optimizer keeps: FusedAdamW gets dense fp32 moments;
    AdamW8bit gets 8-bit moments for params of at least min_8bit_size elements (an 8-bit checkpoint
    saved with dequantize=True comes back with its original codes). With ``ShardedParams`` each rank
    reads only its ranges, whatever number of ranks wrote the checkpoint; an FSDP2 model reads each
    rank's rows (DTensor moments again). State lands on its param's device.

    Live CPU tensors (weights, existing state of a matching layout) are read into in place. With
    ``transactional`` (the default) the checkpoint is first read, verified (every chunk's checksum)
    and converted once without keeping the bytes, and its metadata checked against the model, so
    a bad checkpoint raises with the model and optimizer unchanged; the second read mostly comes
    from the page cache. On several ranks (``ShardedParams``, FSDP2) the ranks agree after their
    checks (one all-reduce): if any rank fails, every rank raises and none changes anything.
    ``transactional=False`` reads once: faster for a checkpoint larger than memory, but a corrupt
    chunk found midway leaves the live tensors partly loaded.

    The model's other tensors a torch.save file or a DCP holds beside the state (buffers such as
    BatchNorm's running stats and counts, frozen params' weights) are copied into the model's
    tensors of their names too, as ``model.load_state_dict`` would; optstate's own formats keep the
    state alone, so a model's buffers stay as they are after loading one.

    Params are matched by name (a ``{"model": ..., "optimizer": ...}`` file of an optimizer built
    without names is named after the model beside it where its groups fit the model one way:
    ``formats/torchsave/FORMAT.md``). A checkpoint whose params are numbered (an ``optimizer.pt`` of an
    optimizer built without names, as Hugging Face's Trainer saves it) is matched with
    ``by_position=True``: param i of the checkpoint is the optimizer's i-th param in group order, as
    torch's ``optimizer.load_state_dict`` matches them (same groups; the weights are not in it).

    What ``optstate inspect`` notes of the read (a save folder read at the save its tracker names,
    values read as the file does not say them) comes as ``optstate.ReadNote`` warnings, once loaded.
    """
    sharded = isinstance(model, ShardedParams)
    to, block, min_size = _target(optimizer)
    if sharded:
        if to == "8bit" and (block, min_size) != (model.block_size, model.min_8bit_size):
            raise ValueError(f"optstate.load: ShardedParams has block_size {model.block_size} and min_8bit_size "
                             f"{model.min_8bit_size}, the optimizer {block} and {min_size}")
        world, rank = model.world, model.rank
    elif _row_sharded(model):  # FSDP2/HSDP: the rows of shard s of S, whatever the replica
        world, rank, _ = _rows_group(model, optimizer)
    else:
        world, rank = 1, 0
    rows = _row_sharded(model)
    group = model.group if sharded else None
    # Tensors that already exist (the live weights, state of a matching layout) are read into in
    # place: a resume neither allocates nor copies them again.
    dest = _Lists()
    params = _params(model, optimizer, by_position)
    for _, p, fqn, whole in params:
        live = _local_rows(whole, fqn, "the parameter") if _is_dtensor(whole) else whole
        if live.is_contiguous() and live.device.type == "cpu":
            dest.add(fqn, "param", "values", live)
        st = optimizer.state.get(p, {})
        for key, t in st.items():
            if _is_dtensor(t):
                t = _local_rows(t, fqn, key)
            if key == "step" or not isinstance(t, torch.Tensor) or not t.is_contiguous():
                continue
            for suffix, comp in (("_codes", "codes"), ("_absmax", "absmax")):
                if key.endswith(suffix):
                    dest.add(fqn, key[:-len(suffix)], comp, t)
                    break
            else:
                dest.add(fqn, key, "values", t)
    # The check pass: before anything is read in place, and on every rank of a sharded load (ranks
    # read different ranges: a corrupt chunk may fail one of them, and then none may load).
    # One open for every read below: opening parses all the checkpoint's metadata.
    others = ck = None
    if transactional and (dest.tensor or world > 1):
        err = None
        try:
            ck = open_checkpoint(path)
            others = _model_targets(path, ck, model, optimizer, "check")
            _load_plan(path, json.loads(ck.check_native_shard(to, block, min_size, world, rank, not rows)), params,
                       optimizer, by_position)
        except Exception as e:  # noqa: BLE001 - raised below, after every rank has had its say
            err = e
        if world > 1:
            _all_ranks_ok(group, err, f"optstate.load: another rank could not load {path} (its error is in its "
                                      f"log); nothing was changed on this rank")
        elif err is not None:
            raise err
    if ck is None:
        ck = open_checkpoint(path)
    if others is None:  # no check pass above: the buffers, read in place, are checked first here
        others = _model_targets(path, ck, model, optimizer, "check" if transactional else "meta")
    meta_json, pnames, enames, cnames, tensors = ck.load_native_shard(to, block, min_size, world, rank, not rows,
                                                                      *dest.args())
    meta = json.loads(meta_json)
    plan, hypers = _load_plan(path, meta, params, optimizer, by_position)
    found = {}
    for fqn, entry, comp, t in zip(pnames, enames, cnames, tensors):
        found.setdefault(fqn, {})[(entry, comp)] = t
    for p, fqn, whole, pm in plan:
        for (entry, comp), t in found.get(fqn, {}).items():
            local_numel = p.to_local().numel() if _is_dtensor(p) else p.numel()
            if comp == "codes" and t.numel() != local_numel:
                raise ValueError(f"optstate.load: '{fqn}.{entry}' holds {t.numel()} codes for a "
                                 f"parameter range of {local_numel}")
    # The model's other tensors, read in place (checked above where transactional, as the state).
    _load_model_tensors(ck, others)
    # Nothing below raises: the checkpoint is applied whole.
    for p, fqn, whole, pm in plan:
        e = found.get(fqn, {})
        dt = _is_dtensor(whole)
        live = whole.to_local() if dt else whole
        if ("param", "values") in e:
            loaded = e[("param", "values")]
            if loaded.data_ptr() != live.data_ptr():
                live.copy_(loaded.reshape(live.shape))
            if sharded:
                s = model.shard_of(p)
                p.copy_(whole.reshape(-1)[s.begin:s.end])
        optimizer.state.pop(p, None)
        if not any(k[0] == "exp_avg" for k in e):
            continue
        # State goes where the optimizer steps it: the param's device (the ops take every tensor,
        # step counters included, on it).
        device = live.device
        shape = live.shape if dt else p.shape  # the local rows of a DTensor; the ShardedParams shard
        st = {"step": torch.tensor(float(pm["step"]), dtype=torch.float32, device=device)}
        for entry in _MOMENTS:
            if (entry, "codes") in e:
                codes = e[(entry, "codes")].reshape(shape).to(device)
                absmax = e[(entry, "absmax")].to(device)
                if dt:  # codes and scales sharded like the rows, as AdamW8bit keeps them under FSDP2
                    codes = DTensor.from_local(codes, whole.device_mesh, whole.placements, run_check=False,
                                               shape=whole.shape, stride=whole.stride())
                    absmax = _fsdp2_absmax(whole, block, absmax)
                st[entry + "_codes"] = codes
                st[entry + "_absmax"] = absmax
            elif (entry, "values") in e:
                local = e[(entry, "values")].reshape(shape).to(device)
                if dt:  # DTensor moments of the param's layout, as FusedAdamW keeps them under FSDP2
                    st[entry] = DTensor.from_local(local, whole.device_mesh, whole.placements, run_check=False,
                                                   shape=whole.shape, stride=whole.stride())
                else:
                    if getattr(optimizer, "_moments_in_param_layout", False) and p.stride() != local.stride():
                        local = torch.empty_like(p, dtype=local.dtype).copy_(local)  # channels_last
                    st[entry] = local
        optimizer.state[p] = st
    for group, gm in zip(optimizer.param_groups, hypers):
        if gm is None:
            continue
        for k in _HYPER:
            if isinstance(group[k], torch.Tensor):
                group[k].fill_(gm[k])  # a tensor lr stays the same tensor (a captured CUDA graph reads it)
            else:
                group[k] = gm[k]
        if "maximize" in group:
            group["maximize"] = gm["maximize"]
        group["betas"] = tuple(gm["betas"])
    warn_read_notes(ck, path)


def _verify_model_tensors(path, ck, model, optimizer):
    """verify's check of the model's other tensors that ``load`` copies in (buffers, frozen
    weights): each against the checkpoint's, in the checkpoint's dtype."""
    if isinstance(model, ShardedParams):
        return []
    names, metas = ck.load_model_tensors("meta", [], [])
    if not names:
        return []
    try:
        pairs = _model_pairs(path, model, optimizer, names, metas)
    except ValueError as e:
        return [str(e).removeprefix("optstate.load: ")]
    live = [t.detach().to(device="cpu", dtype=meta.dtype).contiguous() for t, meta in pairs.values()]
    return list(ck.verify_model_tensors(list(pairs), live))


@gc_paused
def verify(path, model, optimizer, by_position=False):
    """Resume validation: right after ``load``, is the live state exactly the checkpoint's? Returns
    the list of differences (empty when it is), each naming the entry, the rank and the first
    differing element. Every rank checks its own ranges and the whole weights, and the model's
    other tensors ``load`` copies in (buffers, frozen weights). ``by_position`` as for ``load``."""
    ck = open_checkpoint(path)
    if _row_sharded(model):  # FSDP2/HSDP: every rank checks its rows, weights included
        world, rank, _ = _rows_group(model, optimizer)
        meta, lists = _state_lists(model, optimizer, world, rank, whole_param=False, by_position=by_position)
        return list(ck.verify_native_shard(meta, *lists.args(), world, rank, False)) + \
            _verify_model_tensors(path, ck, model, optimizer)
    world, rank = (model.world, model.rank) if isinstance(model, ShardedParams) else (1, 0)
    meta, lists = _state_lists(model, optimizer, 1, 0, whole_param=True, by_position=by_position)
    return list(ck.verify_native_shard(meta, *lists.args(), world, rank, True)) + \
        _verify_model_tensors(path, ck, model, optimizer)
