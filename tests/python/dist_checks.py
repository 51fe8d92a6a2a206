"""Checks shared by the multi-rank scripts the sharded tests launch (they find this module through
PYTHONPATH, which test_sharded.run_on_ranks sets)."""
import torch
from torch.distributed.tensor import DTensor


def full(t):
    """A tensor's whole value, flattened: a DTensor gathered from every rank."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).reshape(-1)


def same_run(m1, o1, m2, o2):
    """Whether two models and their optimizers hold the same params and state, bit for bit, whatever
    each is sharded like."""
    ok = all(torch.equal(full(a), full(b)) for a, b in zip(m1.parameters(), m2.parameters()))
    for p, q in zip(m1.parameters(), m2.parameters()):
        ok &= o1.state[p].keys() == o2.state[q].keys()
        ok &= all(torch.equal(full(v), full(o2.state[q][k])) for k, v in o1.state[p].items())
    return ok
