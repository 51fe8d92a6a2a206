"""optstate optimizers as torch.optim.Optimizer subclasses. The update itself is the C++ kernel."""
import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without distributed: no DTensor params can exist
    DTensor = ()

from ._ops import ops


def _check_hyperparameters(name, lr, betas, eps, weight_decay):
    if isinstance(lr, torch.Tensor):
        # As torch's optimizers: a tensor lr is updated in place by LR schedulers; on the params' GPU
        # the CUDA step reads it on the device, so a captured CUDA graph follows the schedule.
        if lr.numel() != 1:
            raise ValueError(f"{name}: a tensor lr must have one element, got {lr.numel()}")
        if lr.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{name}: a tensor lr must be float32 or float64, got {lr.dtype}")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid betas: {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _refuse_new_state_in_capture(name, p):
    """A CUDA graph being captured would record the new state's zero fills without running them (the
    state would hold whatever the graph's memory held): refused, saying what to do."""
    if p.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{name}: the first step of a param makes its state, which a CUDA graph cannot "
                           "record; run one step eagerly before capturing (a warm-up, as torch.cuda.graph "
                           "asks) and capture the steps after it")


def _local(t):
    """A DTensor's local shard (FSDP2 shards params by rows; the update is elementwise, so stepping
    each rank's rows is the whole step); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _working_param(optimizer, name, p):
    """(the tensor the step updates for `p`, the tensor to copy it back into after the step or None).

    torch's AdamW steps params of any layout; the kernels take flat tensors in logical (row-major)
    order, as the state and its 8-bit blocks are laid out. A param stored otherwise (a channels_last
    conv weight, a transposed view) is stepped through a contiguous copy, refreshed from it before
    the step and written back after. The copy is kept between steps (outside the state: it is not
    saved), so a CUDA step finds the same tensors each time (its cached plan, a graph capture)."""
    local = _local(p)
    if local.is_contiguous():
        return local, None
    copies = optimizer.__dict__.setdefault("_optstate_working_copies", {})
    work = copies.get(p)
    if work is None or work.shape != local.shape or work.dtype != local.dtype or work.device != local.device:
        _refuse_new_state_in_capture(name, local)
        work = torch.empty_like(local, memory_format=torch.contiguous_format)
        copies[p] = work
    work.copy_(local)
    return work, local


def _write_back(pending):
    for work, local in pending:
        local.copy_(work)


def _rows_layout(p):
    """(mesh dim, ranks on it) of a DTensor FSDP2 lays out by rows: one Shard(0) placement, every
    other mesh dim Replicate -- fully_shard on a 1-d mesh, or HSDP's (Replicate(), Shard(0)) on a
    2-d (replicate, shard) mesh, whose replicas hold the same rows. None for any other layout (TP's
    Shard(1), two shard dims, a 0-d param)."""
    from torch.distributed.tensor import Replicate, Shard
    placements = tuple(p.placements)
    shard_dims = [d for d, pl in enumerate(placements) if pl == Shard(0)]
    if p.dim() == 0 or len(shard_dims) != 1 or any(
            pl != Replicate() for d, pl in enumerate(placements) if d != shard_dims[0]):
        return None
    return shard_dims[0], p.device_mesh.size(shard_dims[0])


def _fsdp2_rows(p):
    """(rows, elements per row, rows per rank) of a DTensor param FSDP2 shards by dim 0 (torch.chunk:
    ceil-sized, over the ranks of its shard mesh dim), or None for any other layout."""
    layout = _rows_layout(p)
    if layout is None:
        return None
    rows = p.shape[0]
    world = layout[1]
    return rows, (p.numel() // rows if rows else 0), -(-rows // world)


def _check_fsdp2_blocks(p, block):
    """8-bit state of an FSDP2 param needs every rank's rows to begin on a quantization block of the
    whole parameter, and its scales to shard like its rows: a row length that is a multiple of the
    block (2-d and up), or a 1-d param whose per-rank length is. Otherwise a clear error."""
    layout = _fsdp2_rows(p)
    ok = False
    if layout is not None:
        rows, row_len, rows_per_rank = layout
        ok = row_len % block == 0 if p.dim() > 1 else rows_per_rank % block == 0
    if not ok:
        raise NotImplementedError(
            f"optstate.AdamW8bit: a DTensor param of shape {list(p.shape)} with placements {tuple(p.placements)} "
            f"on a mesh of shape {tuple(p.device_mesh.shape)}: its 8-bit blocks of {block} would straddle ranks. "
            f"FSDP2 (Shard(0) on a 1-d mesh, or HSDP's (Replicate(), Shard(0))) is supported where each row holds "
            f"whole blocks (a 1-d param: each "
            f"rank's share). Use a block_size that divides the row length, a min_8bit_size above {p.numel()} "
            f"to keep this param's moments dense, or optstate.ShardedParams (ZeRO-1)")


def _fsdp2_absmax(p, block, local_values=None):
    """The scales of an FSDP2 param's 8-bit moment as a DTensor sharded like its rows: [rows, blocks
    per row] (2-d and up) or [blocks] (1-d), so dcp.save writes each rank's own and any reader
    flattens them back into block order. Zeros, or this rank's `local_values` in block order."""
    from torch.distributed.tensor import DTensor as _DTensor
    rows, row_len, _ = _fsdp2_rows(p)
    local_rows = p.to_local().shape[0] if p.to_local().dim() else 0
    if p.dim() > 1:
        shape, local = (rows, row_len // block), (local_rows, row_len // block)
    else:
        shape, local = (-(-rows // block),), (-(-local_rows // block),)
    if local_values is None:
        t = torch.zeros(local, dtype=torch.float32, device=p.to_local().device)
    else:
        t = local_values.reshape(local)
    stride = (shape[1], 1) if len(shape) == 2 else (1,)
    return _DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                               stride=stride)


def _load_state_dict(optimizer, state_dict, param_layout=False):
    """torch.optim.Optimizer.load_state_dict keeping the state's dtypes. torch casts every state
    tensor but `step` to its param's dtype, right for its own optimizers, wrong for these: uint8
    codes would become floats, and the fp32 moments of bf16 params would be rounded to bf16. Here
    each tensor keeps its dtype and moves to its param's device (where the step ops take it, step
    counters included); groups and hyperparameters load as torch loads them. Load hooks run as in
    torch: pre hooks see (and may replace) the whole state dict, post hooks see the loaded state."""
    state_dict = state_dict.copy()
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    # torch's loader does the groups (and their checks) only; its hooks run here, around all of it.
    pre, post = optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks
    optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks = {}, {}
    try:
        torch.optim.Optimizer.load_state_dict(optimizer, {**state_dict, "state": {}})
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks = pre, post
    saved = state_dict["state"]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, p in zip(ids, params):
        if pid not in saved:
            continue
        optimizer.state[p] = {k: _loaded_tensor(v, p, param_layout) if isinstance(v, torch.Tensor) else v
                              for k, v in saved[pid].items()}
    for hook in post.values():
        hook(optimizer)


def _loaded_tensor(t, p, param_layout):
    """A loaded state tensor on its param's device. torch's AdamW keeps its moments in the param's
    layout (a channels_last conv weight's are channels_last): with `param_layout` (FusedAdamW) a
    moment of the param's shape takes the param's layout, else (8-bit state, whose blocks follow
    logical order) every tensor is taken contiguous."""
    t = t.to(device=p.device)
    if isinstance(t, DTensor) or isinstance(p, DTensor):
        return t
    if param_layout and t.shape == p.shape and t.dim() > 0:
        return t if t.stride() == p.stride() else torch.empty_like(p, dtype=t.dtype).copy_(t)
    return t if t.is_contiguous() else t.contiguous()


def _with_lr(op, lr):
    """The op overload for this lr: `tensor_lr` for a tensor (read where it lives, when the step
    runs), the float one otherwise."""
    return (op.tensor_lr, lr) if isinstance(lr, torch.Tensor) else (op.default, float(lr))


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW semantics) with one fused pass per element over all parameters.

    State per parameter: ``step`` (float32 scalar tensor, as torch's AdamW), ``exp_avg`` and
    ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), always float32, also for bf16 params.
    FSDP2 (DTensor) params are stepped shard by shard and get DTensor moments of the same layout,
    as torch's AdamW does, so ``get_state_dict`` + ``dcp.save`` work as with torch's optimizers.
    Params stored other than contiguously (channels_last) keep moments in their layout, as torch's
    AdamW does, and step in place; with contiguous moments (``optstate.load``) through a kept
    contiguous copy (``_working_param``).
    """

    _moments_in_param_layout = True  # for optstate.load: dense moments take the param's layout

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 maximize=False):
        _check_hyperparameters("FusedAdamW", lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict):
        """As torch's, except that the state keeps its dtypes (fp32 moments also for bf16 params);
        moments take their param's layout."""
        _load_state_dict(self, state_dict, param_layout=True)

    def _init_state(self, p, amsgrad):
        state = self.state[p]
        if len(state) == 0 or (amsgrad and "max_exp_avg_sq" not in state):
            _refuse_new_state_in_capture("FusedAdamW", p)
        if len(state) == 0:
            # In the param's layout, as torch's AdamW keeps them: a channels_last param then steps in
            # place over storage order (_step_tensors).
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        return state

    def _step_tensors(self, p, moments):
        """(param, grad, write-back) for the op: a param in a dense layout its moments share
        (channels_last, as _init_state makes them) steps in place over storage order, its grad
        given that layout; one with contiguous moments (loaded) through a working copy."""
        local = _local(p)
        grad = _local(p.grad)
        if all(_local(m).stride() == local.stride() for m in moments):
            if grad.stride() != local.stride():
                grad = torch.empty_like(local).copy_(grad)
            return local, grad, None
        work, back = _working_param(self, "FusedAdamW", p)
        return work, grad.contiguous(), back

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, m, v, vmax, steps, pending = [], [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                state = self._init_state(p, group["amsgrad"])
                moments = [state["exp_avg"], state["exp_avg_sq"]] + ([state["max_exp_avg_sq"]] if group["amsgrad"] else [])
                work, grad, back = self._step_tensors(p, moments)
                if back is not None:
                    pending.append((work, back))
                params.append(work)
                grads.append(grad)
                m.append(_local(state["exp_avg"]))
                v.append(_local(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    vmax.append(_local(state["max_exp_avg_sq"]))
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            op, lr = _with_lr(ops.fused_adamw_, group["lr"])
            op(params, grads, m, v, vmax, steps, lr, float(beta1), float(beta2), float(group["eps"]),
               float(group["weight_decay"]), bool(group["amsgrad"]), bool(group["maximize"]))
            _write_back(pending)
        return loss


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with blockwise 8-bit moments, bit-compatible with torchao's AdamW8bit.

    Same maps, codes, scales and update arithmetic; the bias corrections use the correctly rounded
    float32 power, on CPU and CUDA alike, where torch's CPU pow (glibc's powf) is off by an ulp at
    some steps (docs/numerics.md).

    Per-parameter state holds plain tensors only: ``step`` (float32 scalar), and for parameters with
    at least ``min_8bit_size`` elements ``exp_avg_codes``/``exp_avg_sq_codes`` (uint8, the param's
    shape) with ``exp_avg_absmax``/``exp_avg_sq_absmax`` (float32, one per block of ``block_size``
    flattened elements; the last block may be partial); smaller parameters keep dense float32
    ``exp_avg``/``exp_avg_sq``. The block size and map names are in the param group.

    FSDP2 (DTensor) params, HSDP's included, are stepped shard by shard where every rank's rows hold
    whole blocks of the parameter (its row length a multiple of ``block_size``; for a 1-d param, each rank's share):
    codes and scales are then DTensors sharded like the rows, the step equals the unsharded one bit
    for bit, and ``optstate.save``/``load``/``verify`` as well as ``get_state_dict`` + ``dcp.save``
    (optstate reads that DCP) handle it. Other layouts are refused by name.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 block_size=256, min_8bit_size=4096):
        _check_hyperparameters("AdamW8bit", lr, betas, eps, weight_decay)
        if not 0 < block_size <= (1 << 20):
            raise ValueError(f"Invalid block_size: {block_size}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        block_size=block_size, min_8bit_size=min_8bit_size,
                        exp_avg_qmap="dynamic-signed", exp_avg_sq_qmap="dynamic-unsigned")
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict):
        """As torch's, except that the state keeps its dtypes (uint8 codes, fp32 scales and moments)."""
        _load_state_dict(self, state_dict)

    @staticmethod
    def _zero_moment(state, name, p, block):
        if block > 0:
            # A DTensor param gets DTensor codes of its layout (zeros_like keeps it) and scales laid
            # out to match (_fsdp2_absmax).
            state[name + "_codes"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
            if isinstance(p, DTensor):
                state[name + "_absmax"] = _fsdp2_absmax(p, block)
            else:
                state[name + "_absmax"] = torch.zeros((p.numel() + block - 1) // block, dtype=torch.float32,
                                                      device=p.device)
        else:
            state[name] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _init_state(self, p, group):
        state = self.state[p]
        if len(state) == 0 or (group["amsgrad"] and "max_exp_avg_sq" not in state
                               and "max_exp_avg_sq_codes" not in state):
            _refuse_new_state_in_capture("AdamW8bit", p)
        if len(state) == 0:
            # 8-bit or dense is decided on the parameter's global size (DESIGN §1); a shard from
            # ShardedParams carries the size of the whole parameter.
            numel = getattr(p, "_optstate_global_numel", p.numel())
            block = group["block_size"] if numel >= group["min_8bit_size"] else 0
            if block and isinstance(p, DTensor):
                _check_fsdp2_blocks(p, block)
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
            for name in ("exp_avg", "exp_avg_sq"):
                self._zero_moment(state, name, p, block)
        block = group["block_size"] if "exp_avg_codes" in state else 0
        if group["amsgrad"] and "max_exp_avg_sq" not in state and "max_exp_avg_sq_codes" not in state:
            self._zero_moment(state, "max_exp_avg_sq", p, block)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        empty = torch.empty(0)
        for group in self.param_groups:
            lists = {k: [] for k in ("p", "g", "m", "v", "x", "ma", "va", "xa", "step", "block")}
            pending = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                # FSDP2 (DTensor) params: each rank steps its rows; their 8-bit blocks are the whole
                # parameter's (_check_fsdp2_blocks), so the result is the unsharded step's.
                state = self._init_state(p, group)
                block = group["block_size"] if "exp_avg_codes" in state else 0
                work, local = _working_param(self, "AdamW8bit", p)
                if local is not None:
                    pending.append((work, local))
                lists["p"].append(work)
                lists["g"].append(_local(p.grad).contiguous())
                lists["step"].append(state["step"])
                lists["block"].append(block)
                if block:
                    lists["m"].append(_local(state["exp_avg_codes"]))
                    lists["v"].append(_local(state["exp_avg_sq_codes"]))
                    lists["ma"].append(_local(state["exp_avg_absmax"]).view(-1))
                    lists["va"].append(_local(state["exp_avg_sq_absmax"]).view(-1))
                    if group["amsgrad"]:
                        lists["x"].append(_local(state["max_exp_avg_sq_codes"]))
                        lists["xa"].append(_local(state["max_exp_avg_sq_absmax"]).view(-1))
                else:
                    lists["m"].append(_local(state["exp_avg"]))
                    lists["v"].append(_local(state["exp_avg_sq"]))
                    lists["ma"].append(empty)
                    lists["va"].append(empty)
                    if group["amsgrad"]:
                        lists["x"].append(_local(state["max_exp_avg_sq"]))
                        lists["xa"].append(empty)
            if not lists["p"]:
                continue
            beta1, beta2 = group["betas"]
            op, lr = _with_lr(ops.adamw8bit_, group["lr"])
            op(lists["p"], lists["g"], lists["m"], lists["v"], lists["x"], lists["ma"], lists["va"], lists["xa"],
               lists["step"], lists["block"], lr, float(beta1), float(beta2), float(group["eps"]),
               float(group["weight_decay"]), bool(group["amsgrad"]))
            _write_back(pending)
        return loss
