"""A tensor lr (torch's form for capturable optimizers and LR schedules under CUDA graphs).

The ops' `tensor_lr` overloads read the lr where it lives when the step runs; LR schedulers update
it in place (`fill_`). On the CPU these tests show the tensor path equals the float path bit for bit
under a schedule, keeps the group's tensor (its identity, which a captured graph depends on) through
scheduling, save/load and state_dict, and rejects bad tensors. The GPU half (a captured CUDA graph
following the schedule) is in tests/gpu/check_cuda.py.
"""
import pytest
import torch

import optstate
from optstate._ops import ops

SHAPES = [(64, 80), (4096,), (7,)]  # 8-bit (blocks) and dense state for AdamW8bit


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).requires_grad_(True) for s in SHAPES]
    return ps


def _train(opt, params, steps, sched=None):
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()
        if sched is not None:
            sched.step()


MAKERS = {
    "FusedAdamW": lambda ps, lr: optstate.FusedAdamW(ps, lr=lr, weight_decay=0.1, amsgrad=True),
    "AdamW8bit": lambda ps, lr: optstate.AdamW8bit(ps, lr=lr, weight_decay=0.1, block_size=256, min_8bit_size=4096),
}


def _state_equal(a_opt, b_opt, a_params, b_params):
    for pa, pb in zip(a_params, b_params):
        assert torch.equal(pa, pb)
        sa, sb = a_opt.state[pa], b_opt.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_tensor_lr_under_a_schedule_equals_float_lr(name):
    make = MAKERS[name]
    fp, tp = _params(), _params()
    float_opt = make(fp, 1e-2)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    tensor_opt = make(tp, lr)
    sched = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)  # noqa: E731
    fs, ts = sched(float_opt), sched(tensor_opt)
    _train(float_opt, fp, 7, fs)
    _train(tensor_opt, tp, 7, ts)
    assert tensor_opt.param_groups[0]["lr"] is lr  # updated in place, as a captured graph needs
    assert lr.item() == float_opt.param_groups[0]["lr"] != 1e-2
    _state_equal(float_opt, tensor_opt, fp, tp)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_float32_tensor_lr_is_its_value(name):
    make = MAKERS[name]
    value = torch.tensor(3e-3, dtype=torch.float32)
    fp, tp = _params(), _params()
    float_opt, tensor_opt = make(fp, float(value)), make(tp, value)
    _train(float_opt, fp, 3)
    _train(tensor_opt, tp, 3)
    _state_equal(float_opt, tensor_opt, fp, tp)
    value.fill_(1e-3)  # in place, between steps: the next step uses it
    float_opt.param_groups[0]["lr"] = float(value)
    _train(float_opt, fp, 2)
    _train(tensor_opt, tp, 2)
    _state_equal(float_opt, tensor_opt, fp, tp)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_save_load_and_state_dict_keep_the_lr_tensor(tmp_path, name):
    make = MAKERS[name]
    model = torch.nn.Linear(64, 80)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    opt = make(list(model.parameters()), lr)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    optstate.save(tmp_path / "ckpt", model, opt)
    lr.fill_(5.0)
    optstate.load(tmp_path / "ckpt", model, opt)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 1e-2
    assert optstate.verify(tmp_path / "ckpt", model, opt) == []
    sd = opt.state_dict()
    fresh = make(list(model.parameters()), torch.tensor(0.0, dtype=torch.float64))
    fresh.load_state_dict(sd)
    assert float(fresh.param_groups[0]["lr"]) == 1e-2


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_bad_tensor_lr_is_refused(name):
    make = MAKERS[name]
    with pytest.raises(ValueError, match="one element"):
        make(_params(), torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match="float32 or float64"):
        make(_params(), torch.tensor(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        make(_params(), torch.tensor(-1e-3))


def test_ops_check_the_tensor_lr():
    p = torch.zeros(8)
    g, m, v = torch.ones(8), torch.zeros(8), torch.zeros(8)
    step = torch.zeros((), dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"optstate.fused_adamw_: a tensor lr must have one element, got 2"):
        ops.fused_adamw_.tensor_lr([p], [g], [m], [v], [], [step], torch.ones(2), 0.9, 0.999, 1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"optstate.adamw8bit_: a tensor lr must be float32 or float64"):
        ops.adamw8bit_.tensor_lr([p], [g], [m], [v], [], [torch.empty(0)], [torch.empty(0)], [], [step], [0],
                                 torch.tensor(1, dtype=torch.int32), 0.9, 0.999, 1e-8, 0.0, False)
    assert step.item() == 0.0 and torch.equal(p, torch.zeros(8))  # refused before any change
    ops.fused_adamw_.tensor_lr([p], [g], [m], [v], [], [step], torch.tensor(0.5), 0.9, 0.999, 1e-8, 0.0, False, False)
    assert step.item() == 1.0 and torch.allclose(p, torch.full((8,), -0.5))
