"""AdamW8bit and the blockwise 8-bit codec against torchao itself (pure-Python parts, run on CPU).

What is asserted:
- maps: optstate's dynamic-signed/unsigned == torchao's create_dynamic_map(True/False), bit for bit;
- codec: codes, absmax and dequantized values == torchao's scale_tensor / quantize_8bit_with_qmap /
  dequant_with_qmap, bit for bit, on many shapes and scales (zeros, denormals, huge values, NaN,
  exact midpoints between map entries);
- trajectory, 20 steps, same init and gradients:
  * vs torchao's own single_param_adam run eagerly with an IEEE-754 sqrt: params, codes and absmax
    bitwise equal (fp32 and bf16 params);
  * vs torchao's eager step as shipped: eager Tensor.sqrt on CPU is MKL VML's vsSqrt, which is
    not correctly rounded (about 20% of results 1 ulp off), so a few denominators differ by an ulp;
    reported and bounded;
  * vs torchao's torch.compile'd step (as users run it): inductor's generated code differs in
    rounding details; reported and bounded.
- the kernel's CPU paths (AVX-512 with either quantizer, AVX2, generic, picked by OPTSTATE_CPU_ISA) give the same params
  and state bit for bit through the Python optimizer.
"""
import contextlib
import json

import pytest
import torch

import optstate

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim import quant_utils as qu  # noqa: E402
import torchao.optim.adam as tadam  # noqa: E402

MAPS = {True: "dynamic-signed", False: "dynamic-unsigned"}


def bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("signed", [True, False])
def test_maps_equal_torchao(signed):
    ref = torch.tensor(qu.create_dynamic_map(signed), dtype=torch.float32)
    ours = optstate.ops.qmap(MAPS[signed])
    assert torch.equal(bits(ours), bits(ref))
    if signed:
        assert ours[127] == 0 and ours[255] == 1.0 and abs(ours[0].item() + 0.99297) < 1e-5
    else:
        assert ours[0] == 0 and ours[255] == 1.0


def _hard_values(n, signed, g):
    qmap = torch.tensor(qu.create_dynamic_map(signed))
    mids = (qmap[1:] + qmap[:-1]) / 2  # exact midpoints: ties must round up
    parts = [
        torch.randn(n, generator=g),
        torch.zeros(64),
        torch.full((64,), 1e-40),  # denormals
        torch.full((64,), 3e38),   # huge
        mids.repeat(2),
        qmap.repeat(2),
        torch.nextafter(mids, torch.full_like(mids, -1.0)),
        torch.nextafter(mids, torch.full_like(mids, 1.0)),
    ]
    x = torch.cat(parts)
    return x if signed else x.abs()


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1e-3, 1.0, 1e5, 1e30])
@pytest.mark.parametrize("block", [64, 256, 2048])
def test_codec_bitwise_equal_torchao(signed, scale, block):
    g = torch.Generator().manual_seed(int(scale * 0 + block))
    x = _hard_values(block * 8, signed, g)
    x = x[: (x.numel() // block) * block] * scale
    x = x[torch.randperm(x.numel(), generator=g)]
    qmap = torch.tensor(qu.create_dynamic_map(signed), dtype=torch.float32)
    xs, sc = qu.scale_tensor(x, block)
    codes = qu.quantize_8bit_with_qmap(xs, qmap)
    ours_codes, ours_absmax = optstate.ops.quantize_blockwise(x, block, MAPS[signed])
    assert torch.equal(ours_codes, codes)
    assert torch.equal(bits(ours_absmax), bits(sc))
    deq = qu.dequant_with_qmap(codes, qmap, sc)
    ours_deq = optstate.ops.dequantize_blockwise(ours_codes, ours_absmax, block, MAPS[signed])
    assert torch.equal(bits(ours_deq), bits(deq))


def test_codec_nan_block_matches_torchao():
    x = torch.randn(512)
    x[3] = float("nan")
    qmap = torch.tensor(qu.create_dynamic_map(True))
    xs, sc = qu.scale_tensor(x, 256)
    codes = qu.quantize_8bit_with_qmap(xs, qmap)
    ours_codes, ours_absmax = optstate.ops.quantize_blockwise(x, 256, "dynamic-signed")
    assert torch.equal(ours_codes, codes)
    assert torch.isnan(ours_absmax[0]) and torch.isnan(sc[0]) and torch.equal(ours_absmax[1:], sc[1:])


SHAPES = [(64, 256), (4096,), (100,)]


def _trajectory(dtype, steps=20, wd=0.1, amsgrad=False, compiled=False, betas=(0.9, 0.999), jump_to=None):
    """`steps` steps of both optimizers; with `jump_to`, both step counters are set to it after the
    first step (as a resumed run's would be), so the rest run at steps jump_to + 1, ..."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    a = [x.clone().requires_grad_() for x in init]
    b = [x.clone().requires_grad_() for x in init]
    oa = optstate.AdamW8bit(a, lr=1e-2, betas=betas, weight_decay=wd, amsgrad=amsgrad)
    ob = torchao_optim.AdamW8bit(b, lr=1e-2, betas=betas, weight_decay=wd, amsgrad=amsgrad)
    for step in range(steps):
        if step == 1 and jump_to is not None:
            for x, y in zip(a, b):
                oa.state[x]["step"].fill_(jump_to)
                ob.state[y]["step"].fill_(jump_to)
        gg = torch.Generator().manual_seed(100 + step)
        for x, y, s in zip(a, b, SHAPES):
            grad = torch.randn(s, generator=gg).to(dtype)
            x.grad, y.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
    return a, b, oa, ob


@contextlib.contextmanager
def torchao_eager(ieee_sqrt):
    """torchao's single_param_adam without torch.compile; optionally with a correctly rounded sqrt."""
    saved_compile, saved_sqrt = tadam.torch.compile, torch.Tensor.sqrt
    tadam.torch.compile = lambda fn, **kw: fn
    if ieee_sqrt:
        torch.Tensor.sqrt = lambda self: torch.sqrt(self.double()).to(self.dtype)
    try:
        yield
    finally:
        tadam.torch.compile, torch.Tensor.sqrt = saved_compile, saved_sqrt


@contextlib.contextmanager
def correctly_rounded_pow():
    """torchao's `beta ** step` (step a float32 tensor) as the double power of float32(beta) rounded
    once to float32: optstate's bias corrections, on CPU and CUDA alike. torch's CPU pow of a float32
    tensor is glibc's powf, within 0.82 ulp but not correctly rounded."""
    saved = torch.Tensor.__rpow__

    def rpow(self, base):
        return torch.pow(torch.tensor(base, dtype=self.dtype).double(), self.double()).to(self.dtype)

    torch.Tensor.__rpow__ = rpow
    try:
        yield
    finally:
        torch.Tensor.__rpow__ = saved


def _compare(a, b, oa, ob):
    out = []
    for x, y in zip(a, b):
        sa, sb = oa.state[x], ob.state[y]
        row = {"shape": tuple(x.shape), "param_max_diff": (x.float() - y.float()).abs().max().item()}
        if "exp_avg_codes" in sa:
            for k, qm in (("exp_avg", "dynamic-signed"), ("exp_avg_sq", "dynamic-unsigned")):
                t = sb[k]
                ours = optstate.ops.dequantize_blockwise(sa[k + "_codes"], sa[k + "_absmax"], 256, qm)
                row[k + "_codes_equal"] = (sa[k + "_codes"] == t.codes).float().mean().item()
                row[k + "_absmax_equal"] = bool(torch.equal(bits(sa[k + "_absmax"]), bits(t.scale)))
                row[k + "_max_deq_diff"] = (ours.view(-1) - t.dequantize().view(-1)).abs().max().item()
        out.append(row)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_trajectory_bitwise_vs_torchao_step_with_ieee_sqrt(dtype, wd):
    # amsgrad is left out: torchao's step only runs it compiled (eagerly, OptimState8bit.float()
    # returns the subclass and torch.maximum on it raises NotImplementedError).
    with torchao_eager(ieee_sqrt=True):
        a, b, oa, ob = _trajectory(dtype, wd=wd)
    for x, y in zip(a, b):
        if "exp_avg_codes" not in oa.state[x] and dtype == torch.bfloat16:
            continue  # torchao keeps bf16 dense state for small bf16 params; optstate keeps fp32
        assert torch.equal(x, y), f"param {tuple(x.shape)} differs"
    for row in _compare(a, b, oa, ob):
        for k in ("exp_avg", "exp_avg_sq"):
            if k + "_codes_equal" in row:
                assert row[k + "_codes_equal"] == 1.0 and row[k + "_absmax_equal"], row


def _report_and_bound(rows, param_max_diff):
    """Prints the comparison rows; every param within `param_max_diff`, >= 99.9% of codes equal."""
    print(json.dumps(rows, indent=1))
    for row in rows:
        assert row["param_max_diff"] <= param_max_diff
        for k in ("exp_avg", "exp_avg_sq"):
            if k + "_codes_equal" in row:
                assert row[k + "_codes_equal"] >= 0.999, row


def test_trajectory_across_a_powf_misrounding():
    # beta2 = 0.9999 at step 508: glibc's powf gives 0x1.e6a27ap-1, one ulp above the correctly
    # rounded 0x1.e6a278p-1; 1 - x cancels, so bias_correction2.sqrt() moves by 18 ulps that step.
    # optstate uses the correctly rounded power (so that its CUDA step can give the CPU's bits):
    # with that one pow in torchao's step (and an IEEE sqrt), steps 504-509 stay bitwise equal.
    kw = dict(steps=7, betas=(0.9, 0.9999), jump_to=503.0)
    with torchao_eager(ieee_sqrt=True), correctly_rounded_pow():
        a, b, oa, ob = _trajectory(torch.float32, **kw)
    for x, y in zip(a, b):
        assert torch.equal(bits(x.detach()), bits(y.detach())), f"param {tuple(x.shape)} differs"
    for row in _compare(a, b, oa, ob):
        for k in ("exp_avg", "exp_avg_sq"):
            if k + "_codes_equal" in row:
                assert row[k + "_codes_equal"] == 1.0 and row[k + "_absmax_equal"], row
    # torchao's step as shipped on CPU (glibc's powf): that step's update differs by about 1e-6 of
    # itself, so params by a few ulps.
    with torchao_eager(ieee_sqrt=True):
        a, b, oa, ob = _trajectory(torch.float32, **kw)
    _report_and_bound(_compare(a, b, oa, ob), param_max_diff=1e-6)


def test_trajectory_vs_torchao_eager_as_shipped():
    with torchao_eager(ieee_sqrt=False):
        a, b, oa, ob = _trajectory(torch.float32)
    _report_and_bound(_compare(a, b, oa, ob), param_max_diff=1e-5)


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")
def test_trajectory_vs_torchao_compiled():
    global SHAPES
    saved, SHAPES = SHAPES, [(64, 256)]  # one shape: one compile (about 20 s on 2 cores)
    try:
        a, b, oa, ob = _trajectory(torch.float32)
    finally:
        SHAPES = saved
    rows = _compare(a, b, oa, ob)
    print(json.dumps(rows, indent=1))
    row = rows[0]
    assert row["param_max_diff"] <= 1e-4
    assert row["exp_avg_codes_equal"] >= 0.999 and row["exp_avg_sq_codes_equal"] >= 0.999


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


def _train(model, opt, start, stop):
    for s in range(start, stop):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(s))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("dequantize", [False, True])
def test_resume_8bit_is_bitwise(tmp_path, dequantize):
    ref = _model()
    ropt = optstate.AdamW8bit(ref.parameters(), lr=1e-2, amsgrad=True)
    _train(ref, ropt, 0, 20)
    model = _model()
    opt = optstate.AdamW8bit(model.parameters(), lr=1e-2, amsgrad=True)
    _train(model, opt, 0, 10)
    optstate.save(tmp_path / "c", model, opt, dequantize=dequantize)
    model2 = _model()
    opt2 = optstate.AdamW8bit(model2.parameters(), lr=0.1)
    optstate.load(tmp_path / "c", model2, opt2)
    assert set(opt2.state[model2[0].weight]) == {"step", "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes",
                                                 "exp_avg_sq_absmax", "max_exp_avg_sq_codes",
                                                 "max_exp_avg_sq_absmax"}
    _train(model2, opt2, 10, 20)
    for a, b in zip(ref.parameters(), model2.parameters()):
        assert torch.equal(a, b)
        for k, v in ropt.state[a].items():
            assert torch.equal(v, opt2.state[b][k]), k


def test_state_is_plain_tensors_and_memory_per_param(tmp_path, optstate_cli):
    model = _model()
    opt = optstate.AdamW8bit(model.parameters(), lr=1e-2)
    _train(model, opt, 0, 2)
    st = opt.state[model[0].weight]
    assert all(type(v) is torch.Tensor for v in st.values())
    assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_codes"].shape == model[0].weight.shape
    assert st["exp_avg_absmax"].shape == (128 * 64 // 256,)
    assert "exp_avg" in opt.state[model[0].bias]  # 128 elements < 4096: dense
    assert opt.param_groups[0]["exp_avg_qmap"] == "dynamic-signed"
    optstate.save(tmp_path / "c", model, opt)
    j = json.loads(optstate_cli("inspect", "--json", tmp_path / "c").stdout)
    assert j["params"]["0.weight"]["state_bytes_per_param"] <= 2.04
    assert j["params"]["0.weight"]["entries"]["exp_avg"]["block_size"] == 256


def test_convert_round_trip_and_values_hash(tmp_path, optstate_cli):
    model = _model()
    opt = optstate.AdamW8bit(model.parameters(), lr=1e-2, amsgrad=True)
    _train(model, opt, 0, 5)
    src = tmp_path / "c8"
    optstate.save(src, model, opt)
    before = {p.relative_to(src): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    optstate_cli("convert", src, tmp_path / "f32", "--to", "fp32")
    optstate_cli("convert", tmp_path / "f32", tmp_path / "back", "--to", "8bit")
    after = {p.relative_to(src): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    assert before == after, "convert changed its input"
    raw = [json.loads(optstate_cli("hash", "--json", p).stdout)["root"] for p in (src, tmp_path / "back")]
    assert raw[0] == raw[1], "8-bit -> fp32 -> 8-bit did not reproduce the state"
    values = [json.loads(optstate_cli("hash", "--values", "--json", p).stdout)["root"]
              for p in (src, tmp_path / "f32")]
    assert values[0] == values[1]
    j = json.loads(optstate_cli("inspect", "--json", "--no-stats", tmp_path / "f32").stdout)
    assert j["params"]["0.weight"]["entries"]["exp_avg"]["encoding"] == "dense"
    # The fp32 conversion equals the dequantized optimizer state, bit for bit.
    m8 = _model()
    o8 = optstate.FusedAdamW(m8.parameters())
    optstate.load(tmp_path / "f32", m8, o8)
    st = opt.state[model[0].weight]
    deq = optstate.ops.dequantize_blockwise(st["exp_avg_codes"], st["exp_avg_absmax"], 256, "dynamic-signed")
    assert torch.equal(o8.state[m8[0].weight]["exp_avg"], deq)


def test_failed_convert_leaves_no_output(tmp_path, optstate_cli):
    model = _model()
    opt = optstate.AdamW8bit(model.parameters())
    _train(model, opt, 0, 1)
    optstate.save(tmp_path / "c", model, opt)
    data = next((tmp_path / "c" / "data").iterdir())
    data.write_bytes(data.read_bytes()[:-10])  # truncated source
    proc = optstate_cli("convert", tmp_path / "c", tmp_path / "out", "--to", "fp32", check=False)
    assert proc.returncode == 2 and "rank-00000.bin" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no staging directory left behind
    (tmp_path / "existing").mkdir()
    proc = optstate_cli("convert", tmp_path / "c", tmp_path / "existing", check=False)
    assert proc.returncode == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_keeps_codes_and_continues_bitwise(dtype):
    # torch's Optimizer.load_state_dict casts state to the param's dtype (uint8 codes to floats);
    # optstate's keeps each tensor's dtype, so a loaded optimizer continues bit for bit.
    import copy
    import io
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    a = [x.clone().requires_grad_() for x in init]
    oa = optstate.AdamW8bit(a, lr=1e-2, weight_decay=0.1)

    def step(params, opt, s):
        gg = torch.Generator().manual_seed(100 + s)
        for x, shape in zip(params, SHAPES):
            x.grad = torch.randn(shape, generator=gg).to(dtype)
        opt.step()

    for s in range(3):
        step(a, oa, s)
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    b = [x.detach().clone().requires_grad_() for x in a]
    ob = optstate.AdamW8bit(b, lr=1e-2, weight_decay=0.1)
    # Load hooks run as torch runs them: the pre hook sees the whole state dict, the post hook the
    # loaded state (with its uint8 codes).
    seen = {}
    ob.register_load_state_dict_pre_hook(lambda opt, sd: seen.update(pre=len(sd["state"])))
    ob.register_load_state_dict_post_hook(
        lambda opt: seen.update(post=sorted({v.dtype for st in opt.state.values() for k, v in st.items()
                                             if k.endswith("_codes")}, key=str)))
    ob.load_state_dict(torch.load(buf))
    assert seen == {"pre": len(oa.state), "post": [torch.uint8]}
    for x, y in zip(a, b):
        for k, v in oa.state[x].items():
            assert ob.state[y][k].dtype == v.dtype and torch.equal(ob.state[y][k], v), k
    for s in range(3, 6):
        step(a, oa, s)
        step(b, ob, s)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for k in oa.state[x]:
            assert torch.equal(oa.state[x][k], ob.state[y][k]), k
    assert copy.deepcopy(oa.state_dict())["param_groups"][0]["block_size"] == 256


ISA_SCRIPT = """
import sys, torch, optstate
torch.manual_seed(0)
out = {"isa": optstate.ops.cpu_isa_8bit()}
for dtype in (torch.float32, torch.bfloat16):
    # a 64-multiple block, a partial last block and a tensor below min_8bit_size
    ps = [torch.randn(s).to(dtype).requires_grad_(True) for s in ((300, 64), (5000,), (100,))]
    opt = optstate.AdamW8bit(ps, lr=1e-2, weight_decay=0.1, amsgrad=len(sys.argv) > 2)
    for step in range(4):
        for p in ps:
            p.grad = (torch.randn(p.shape) * 10.0 ** -step).to(dtype)
            p.grad.view(-1)[0] = 0.0
        opt.step()
    for i, p in enumerate(ps):
        out[f"{dtype}.{i}.param"] = p.detach().clone()
        out.update({f"{dtype}.{i}.{k}": v.clone() for k, v in opt.state[p].items()})
torch.save(out, sys.argv[1])
"""


@pytest.mark.parametrize("amsgrad", [False, True])
def test_cpu_paths_give_the_same_bits(tmp_path, amsgrad):
    """The 8-bit kernel's CPU paths (AVX-512 with either quantizer, AVX2, generic: whichever this CPU
    runs, picked by OPTSTATE_CPU_ISA) give the same params and state, bit for bit, through the Python
    optimizer."""
    import os
    import subprocess
    import sys

    script = tmp_path / "isa.py"
    script.write_text(ISA_SCRIPT)
    results = {}
    for isa in ("", "avx512", "avx512-gather", "avx2", "generic"):
        out = tmp_path / f"{isa or 'default'}.pt"
        env = dict(os.environ, OPTSTATE_CPU_ISA=isa)
        args = [sys.executable, str(script), str(out)] + (["amsgrad"] if amsgrad else [])
        subprocess.run(args, check=True, env=env)
        results[isa] = torch.load(out)
    assert results["generic"]["isa"] == "generic"
    assert results[""]["isa"] in ("avx512", "avx512-gather", "avx2+fma", "generic")
    if results[""]["isa"].startswith("avx512"):
        assert results["avx512"]["isa"] == "avx512" and results["avx512-gather"]["isa"] == "avx512-gather"
    ref = results["generic"]
    for isa in ("", "avx512", "avx512-gather", "avx2"):
        got = results[isa]
        assert got.keys() == ref.keys()
        for k, v in ref.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (isa, k)
