"""ZeRO-1 style optimizer sharding over torch.distributed (DESIGN §2).

Every rank keeps the whole model and computes (or all-reduces) the whole gradients; the optimizer
on each rank steps only that rank's range of each parameter: whole rows of dim 0 for dense state,
like FSDP2's ``torch.chunk``, and whole quantization blocks for 8-bit state. That range is exactly
the rank's shard in an optstate checkpoint, so ``optstate.save`` writes it in parallel and
``optstate.load`` on any number of ranks reads only what each rank needs.

    shards = optstate.ShardedParams(model, block_size=256)   # block_size=None for FusedAdamW
    opt = optstate.AdamW8bit(shards.parameters(), block_size=256)
    loss.backward(); shards.scatter_grads(); opt.step(); shards.gather_params()
"""
import torch
import torch.distributed as dist

from ._ops import ops
from .names import named_parameters


def world_and_rank(group=None):
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


class ShardedParam:
    __slots__ = ("fqn", "param", "begin", "end", "local", "block_size")

    def __init__(self, fqn, param, begin, end, local, block_size):
        self.fqn, self.param, self.begin, self.end, self.local, self.block_size = \
            fqn, param, begin, end, local, block_size


class ShardedParams:
    """The rank's ranges of a model's parameters, as leaf tensors an optimizer can own.

    ``block_size``/``min_8bit_size`` must be those of the AdamW8bit that will step them (8-bit
    state is sharded by whole blocks); ``None`` for dense state (FusedAdamW). A rank whose range
    of a parameter is empty holds a zero-size tensor for it, so every rank's optimizer has the same
    parameters and param groups.
    """

    def __init__(self, model, block_size=None, min_8bit_size=4096, group=None):
        self.model = model
        self.group = group
        self.world, self.rank = world_and_rank(group)
        self.block_size = block_size or 0
        self.min_8bit_size = min_8bit_size
        self.shards = []
        for fqn, p in named_parameters(model):
            if not p.requires_grad:
                continue
            block = self.block_size if self.block_size and p.numel() >= min_8bit_size else 0
            begin, end = ops.shard_range(list(p.shape), block, self.world, self.rank)
            local = p.detach().reshape(-1)[begin:end].clone()
            local._optstate_global_numel = p.numel()
            self.shards.append(ShardedParam(fqn, p, begin, end, local, block))
        self._by_local = {id(s.local): s for s in self.shards}

    def parameters(self):
        return [s.local for s in self.shards]

    def named_locals(self):
        return [(s.fqn, s.local) for s in self.shards]

    def shard_of(self, local):
        return self._by_local[id(local)]

    def ranges(self, rank):
        """Every parameter's [begin, end) on `rank`."""
        return [tuple(ops.shard_range(list(s.param.shape), s.block_size, self.world, rank)) for s in self.shards]

    @torch.no_grad()
    def scatter_grads(self):
        """Gives each local shard its range of the (already reduced) whole gradient."""
        for s in self.shards:
            g = s.param.grad
            s.local.grad = None if g is None else g.detach().reshape(-1)[s.begin:s.end].clone()

    @torch.no_grad()
    def gather_params(self):
        """All-gathers the updated ranges so every rank holds the whole updated model again (one
        collective over the raw bytes, so the result is bit for bit the ranks' values)."""
        if self.world == 1:
            for s in self.shards:
                s.param.view(-1).copy_(s.local)
            return
        mine = torch.cat([s.local.view(torch.uint8) for s in self.shards]) if self.shards else torch.empty(0, dtype=torch.uint8)
        sizes = [sum((e - b) * s.param.element_size() for s, (b, e) in zip(self.shards, self.ranges(r)))
                 for r in range(self.world)]
        width = max(sizes)
        send = torch.zeros(width, dtype=torch.uint8)
        send[:mine.numel()] = mine
        recv = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(recv, send, group=self.group)
        for r in range(self.world):
            at = 0
            for s, (b, e) in zip(self.shards, self.ranges(r)):
                n = (e - b) * s.param.element_size()
                s.param.view(-1)[b:e].copy_(recv[r][at:at + n].view(s.param.dtype))
                at += n
