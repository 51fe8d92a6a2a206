"""optstate.FusedAdamW against torch.optim.AdamW itself: same params, same gradients, 1000 steps.

Tolerances (documented in docs/numerics.md):
- fp32 params vs the for-loop AdamW (foreach=False): max |ours - torch| / max |torch| <= 1e-6 per tensor.
- fp32 params vs torch's fused CPU kernel (fused=True): bitwise equal on every element torch runs
  through its AVX2 vector loop (same operations, same order, the same two fused multiply-adds).
  Torch's scalar tail loop (the last numel % 8 elements of each thread's range) mixes in double
  precision, so there the two agree to <= 1e-6 relative only. Torch runs single-threaded in that
  comparison so the tail is exactly the last numel % 8 elements.
- bf16 params with fp32 state vs an eager re-statement with torch ops (fp32 math on the widened
  param, the result rounded to bf16 each step): bitwise equal.
"""
import copy
import itertools

import pytest
import torch

import optstate

STEPS = 1000
SHAPES = [(64, 33), (1000,), (7,), (3, 5, 17)]  # ragged sizes exercise the vector tails
COMBOS = list(itertools.product([False, True], [False, True], [0.0, 0.1]))  # amsgrad, maximize, wd


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(10_000 + step)
    return [(torch.randn(s, generator=g) * (1.0 + (step % 7))).to(dtype) for s in SHAPES]


def _run(make_opt, params, dtype, steps=STEPS):
    ps = [p.clone().requires_grad_(True) for p in params]
    opt = make_opt(ps)
    for step in range(steps):
        for p, g in zip(ps, _grads(step, dtype)):
            p.grad = g
        opt.step()
    return ps, opt


@pytest.mark.parametrize("amsgrad,maximize,wd", COMBOS)
def test_fp32_matches_torch_adamw(amsgrad, maximize, wd):
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    init = _params(torch.float32)
    ours, oopt = _run(lambda ps: optstate.FusedAdamW(ps, **kw), init, torch.float32)
    loop, lopt = _run(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), init, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fused, _ = _run(lambda ps: torch.optim.AdamW(ps, fused=True, **kw), init, torch.float32)
    finally:
        torch.set_num_threads(threads)
    worst = 0.0
    for a, b, c in zip(ours, loop, fused):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        worst = max(worst, rel)
        assert rel <= 1e-6, f"param relative difference {rel} to torch.optim.AdamW"
        vec = a.numel() - a.numel() % 8
        assert torch.equal(a.flatten()[:vec], c.flatten()[:vec]), "not bitwise equal to torch's fused kernel"
        assert ((a - c).abs().max() / c.abs().max()).item() <= 1e-6
    for a, b in zip(ours, loop):
        sa, sb = oopt.state[a], lopt.state[b]
        assert sa["step"].item() == sb["step"].item() == STEPS
        for k in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            rel = ((sa[k] - sb[k]).abs().max() / sb[k].abs().max()).item()
            assert rel <= 1e-6, f"{k} relative difference {rel}"
    print(f"amsgrad={amsgrad} maximize={maximize} wd={wd}: max rel diff to for-loop {worst:.3e}")


def _bf16_reference(params_bf16, kw, steps=STEPS):
    """Eager re-statement of our bf16 semantics with torch's own AdamW for-loop on fp32."""
    ps = [p.clone() for p in params_bf16]
    shadow = [p.float().requires_grad_(True) for p in ps]
    opt = torch.optim.AdamW(shadow, foreach=False, **kw)
    for step in range(steps):
        with torch.no_grad():
            for s, p in zip(shadow, ps):
                s.copy_(p.float())
        for s, g in zip(shadow, _grads(step, torch.bfloat16)):
            s.grad = g.float()
        opt.step()
        with torch.no_grad():
            for s, p in zip(shadow, ps):
                p.copy_(s.to(torch.bfloat16))
    return ps, opt, shadow


@pytest.mark.parametrize("amsgrad,maximize,wd", COMBOS)
def test_bf16_params_single_pass(amsgrad, maximize, wd):
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    init = _params(torch.bfloat16)
    steps = 300
    ours, oopt = _run(lambda ps: optstate.FusedAdamW(ps, **kw), init, torch.bfloat16, steps)
    ref, ropt, shadow = _bf16_reference(init, kw, steps)
    for a, b, s in zip(ours, ref, shadow):
        assert a.dtype == torch.bfloat16
        assert oopt.state[a]["exp_avg"].dtype == torch.float32
        # Same math as torch's for-loop on the widened param: within 1e-6 relative before rounding
        # means the bf16 results may differ only where the fp32 value sits on a rounding boundary.
        differ = (a != b).float().mean().item()
        ulp = ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30)).max().item()
        assert differ <= 0.001 and ulp <= 2 ** -7, f"bf16 params differ in {differ:.2%} of elements (rel {ulp})"
        rel = ((oopt.state[a]["exp_avg_sq"] - ropt.state[s]["exp_avg_sq"]).abs().max()
               / ropt.state[s]["exp_avg_sq"].abs().max()).item()
        assert rel <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_is_plain_tensors_and_state_dict_round_trips(dtype):
    # bf16 params keep fp32 moments, also through load_state_dict (torch's would cast them to bf16)
    init = _params(dtype)
    ps, opt = _run(lambda ps: optstate.FusedAdamW(ps, lr=1e-2), init, dtype, steps=5)
    sd = opt.state_dict()
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["step"].dtype == torch.float32 and st["step"].dim() == 0 and st["step"].item() == 5
    assert type(st["exp_avg"]) is torch.Tensor
    ps2 = [p.detach().clone().requires_grad_(True) for p in ps]
    opt2 = optstate.FusedAdamW(ps2, lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(sd))  # as torch.save + torch.load would give
    assert all(opt2.state[p]["exp_avg"].dtype == torch.float32 for p in ps2)
    for step in range(5, 10):
        for a, b, g in zip(ps, ps2, _grads(step, dtype)):
            a.grad, b.grad = g, g.clone()
        opt.step()
        opt2.step()
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


def test_param_groups_and_closure():
    a = torch.ones(10, requires_grad=True)
    b = torch.ones(10, requires_grad=True)
    opt = optstate.FusedAdamW([{"params": [a], "weight_decay": 0.5}, {"params": [b], "lr": 0.0}], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (a.sum() + b.sum()) * 0
        loss.backward()
        return loss

    opt.step(closure)
    assert torch.all(a < 1.0)  # decay applied: 1 - 0.1 * 0.5
    assert torch.all(b == 1.0)  # lr 0 leaves it alone


def test_rejects_bad_arguments():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError):
        optstate.FusedAdamW([p], lr=-1.0)
    with pytest.raises(ValueError):
        optstate.FusedAdamW([p], betas=(1.0, 0.9))
    opt = optstate.FusedAdamW([p.to(torch.float64).detach().requires_grad_()])
    opt.param_groups[0]["params"][0].grad = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        opt.step()


def _conv_model(channels_last, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 8, 3))
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    return m


def _train_conv(cl, ocl, plain, oplain, steps, seed=0):
    """Steps the channels_last model `cl` on its own gradients (channels_last, as autograd makes
    them) and `plain` on the same values, contiguous (a contiguous model's convolution would round
    its gradients differently)."""
    for step in range(steps):
        x = torch.randn(4, 16, 12, 12, generator=torch.Generator().manual_seed(seed + step))
        ocl.zero_grad()
        cl(x.contiguous(memory_format=torch.channels_last)).square().mean().backward()
        for a, b in zip(cl.parameters(), plain.parameters()):
            b.grad = a.grad.contiguous()
        ocl.step()
        oplain.step()


@pytest.mark.parametrize("make", [lambda ps: optstate.FusedAdamW(ps, lr=1e-2, amsgrad=True),
                                  lambda ps: optstate.AdamW8bit(ps, lr=1e-2, min_8bit_size=1024)],
                         ids=["FusedAdamW", "AdamW8bit"])
def test_channels_last_and_transposed_params_step_as_contiguous_ones(make):
    # torch's AdamW steps params of any layout (channels_last conv weights are common on GPUs); the
    # kernels take logical order, so such params step through a working copy. They must give the
    # contiguous run's bits, keep their layout, and carry state that loads into either layout.
    cl, plain = _conv_model(True), _conv_model(False)
    assert not cl[0].weight.is_contiguous()
    ocl, oplain = make(list(cl.parameters())), make(list(plain.parameters()))
    _train_conv(cl, ocl, plain, oplain, 6)
    assert not cl[0].weight.grad.is_contiguous()
    for a, b in zip(cl.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert cl[0].weight.is_contiguous(memory_format=torch.channels_last)
    sa, sb = ocl.state_dict(), oplain.state_dict()
    for i in sb["state"]:
        for k, v in sb["state"][i].items():
            assert torch.equal(sa["state"][i][k], v), k
    # Moments in the param's layout (FusedAdamW, as torch's AdamW) or contiguous (AdamW8bit); then
    # contiguous moments for every param (as a checkpoint loads them): FusedAdamW steps those
    # through a working copy, with the same bits.
    w0 = cl[0].weight
    fused = isinstance(ocl, optstate.FusedAdamW)
    if fused:
        assert ocl.state[w0]["exp_avg"].stride() == w0.stride()
    else:
        assert ocl.state[w0]["exp_avg_codes"].is_contiguous()
    for st in ocl.state.values():
        for k, v in st.items():
            if v.dim():
                st[k] = v.contiguous()
    _train_conv(cl, ocl, plain, oplain, 2, seed=20)
    for a, b in zip(cl.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    # A transposed view as the param, and the gradient in yet another layout.
    w = torch.randn(64, 80)
    pt, pc = torch.nn.Parameter(w.t().contiguous().t()), torch.nn.Parameter(w.clone())
    ot, oc = make([pt]), make([pc])
    for step in range(3):
        g = torch.randn(64, 80, generator=torch.Generator().manual_seed(50 + step))
        pt.grad, pc.grad = g.t().contiguous().t(), g.clone()
        ot.step()
        oc.step()
    assert pt.stride() == (1, 64) and torch.equal(pt, pc)


def test_channels_last_state_from_torch_adamw_loads_and_continues():
    # torch's AdamW keeps a channels_last param's moments channels_last (zeros_like keeps the
    # layout); loaded here they take each param's layout, into a channels_last model and into a
    # contiguous one alike, and the two runs continue bit for bit.
    cl, plain = _conv_model(True), _conv_model(False)
    tcl, tplain = torch.optim.AdamW(cl.parameters(), lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _train_conv(cl, tcl, plain, tplain, 2)
    saved = tcl.state_dict()
    assert not saved["state"][0]["exp_avg"].is_contiguous()
    ocl, oplain = optstate.FusedAdamW(cl.parameters(), lr=1e-2), optstate.FusedAdamW(plain.parameters(), lr=1e-2)
    ocl.load_state_dict(copy.deepcopy(saved))
    oplain.load_state_dict(copy.deepcopy(saved))
    for a, b in zip(cl.parameters(), plain.parameters()):
        for k, v in tcl.state[a].items():
            assert torch.equal(ocl.state[a][k], v) and torch.equal(oplain.state[b][k], v), k
            assert ocl.state[a][k].stride() == a.stride() or k == "step"
            assert oplain.state[b][k].is_contiguous()
    with torch.no_grad():
        for a, b in zip(cl.parameters(), plain.parameters()):
            b.copy_(a)
    _train_conv(cl, ocl, plain, oplain, 3, seed=10)
    for a, b in zip(cl.parameters(), plain.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [optstate.FusedAdamW, optstate.AdamW8bit])
def test_channels_last_save_load_resumes_bitwise(tmp_path, cls):
    # optstate.save / optstate.load of a channels_last model: the weights keep their layout, the run
    # continues as if never stopped, and FusedAdamW's loaded moments take the param's layout again
    # (so the step stays in place, without a working copy).
    a, b, c = _conv_model(True), _conv_model(True), _conv_model(True)
    oa, ob, oc = (cls(m.parameters(), lr=1e-2) for m in (a, b, c))
    _train_conv(a, oa, c, oc, 2)
    optstate.save(tmp_path / "ck", a, oa)
    optstate.load(tmp_path / "ck", b, ob)
    _train_conv(a, oa, b, ob, 2, seed=30)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y) and x.stride() == y.stride()
    w = b[0].weight
    if cls is optstate.FusedAdamW:
        assert ob.state[w]["exp_avg"].stride() == w.stride()
