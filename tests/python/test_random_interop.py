"""Random models through every format and back, against torch itself: params of random shapes (a
scalar, an empty one, 1-d to 3-d, fp32 or bf16), two groups with their own hyperparameters, amsgrad
and maximize on some seeds, a frozen param in a group (never stepped: no state), stepped by
torch.optim.AdamW and saved with torch.save as a training loop does. `optstate convert` takes the
file to native, HDF5, safetensors and DCP and each back to a torch.save file: every hop keeps the
hash, and what comes back is, bit for bit, what torch saved, loading with
`optimizer.load_state_dict` into a fresh optimizer that steps on exactly as the original does. The
DCP also loads through torch's own `dcp.load` + `set_state_dict`."""
import json

import pytest
import torch

from test_formats import hashes

SEEDS = range(6)
FORMATS = [("native", "ckpt"), ("hdf5", "ckpt.h5"), ("safetensors", "ckpt.safetensors"), ("dcp", "ckpt.dcp")]


class Bag(torch.nn.Module):
    """Params of the given shapes and dtype, named p0, p1, ... (registration order = named_parameters order)."""

    def __init__(self, shapes, dtype, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for i, s in enumerate(shapes):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)))


def random_setup(seed):
    g = torch.Generator().manual_seed(1000 + seed)

    def r(n):
        return int(torch.randint(0, n, (1,), generator=g))

    shapes = [(), (0, 5), (1 + r(300),), (1 + r(40), 1 + r(70)), (1 + r(4), 1 + r(9), 1 + r(33)), (64, 64)]
    shapes += [(1 + r(50), 1 + r(20)) for _ in range(r(3))]
    dtype = torch.bfloat16 if seed % 3 == 2 else torch.float32
    groups_kw = [dict(lr=[1e-3, 3e-4][r(2)], weight_decay=[0.0, 0.1][r(2)], betas=(0.9, [0.999, 0.95][r(2)]),
                     eps=[1e-8, 1e-6][r(2)]) for _ in range(2)]
    flags = dict(amsgrad=seed % 2 == 1, maximize=seed % 4 == 3)
    return shapes, dtype, groups_kw, flags


def build(seed):
    shapes, dtype, groups_kw, flags = random_setup(seed)
    model = Bag(shapes, dtype, seed)
    params = list(model.parameters())
    params[-1].requires_grad_(False)  # frozen, yet in a group (torch's own DCP load skips it likewise)
    # the first two and every third param to group 1, the rest to group 0
    split = [[], []]
    for i, p in enumerate(params):
        split[1 if i < 2 or i % 3 == 0 else 0].append(p)
    groups = [dict(params=split[k], **groups_kw[k]) for k in range(2) if split[k]]
    opt = torch.optim.AdamW(groups, **flags)
    return model, opt


def train(model, opt, steps, seed, start=0):
    params = list(model.parameters())
    frozen = params[-1]  # frozen: no gradient, no state
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(seed * 100 + s)
        for p in params:
            p.grad = None if p is frozen else (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
        opt.step()


def same_state(a, b):
    """Two optimizer state_dicts hold the same tensors bit for bit and the same hyperparameters."""
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        assert st.keys() == b["state"][k].keys(), k
        for name, t in st.items():
            u = b["state"][k][name]
            assert t.dtype == u.dtype and t.shape == u.shape, (k, name, t.dtype, u.dtype, t.shape, u.shape)
            assert torch.equal(t.view(-1).view(torch.uint8) if t.numel() else t,
                               u.view(-1).view(torch.uint8) if u.numel() else u), (k, name)
    assert len(a["param_groups"]) == len(b["param_groups"])
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "params"):
            assert ga[key] == gb[key], (key, ga[key], gb[key])


@pytest.mark.parametrize("seed", SEEDS)
def test_random_models_through_every_format_come_back_as_torch_saved_them(tmp_path, optstate_cli, seed):
    model, opt = build(seed)
    train(model, opt, 3, seed)
    src = tmp_path / "src.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    saved = torch.load(src, weights_only=True)  # what torch saved (its state_dict shares live tensors)
    want = hashes(optstate_cli, src)
    assert "p0.exp_avg" in want["entries"] and f"p{len(list(model.parameters())) - 1}.exp_avg" not in want["entries"]
    for fmt, name in FORMATS:
        dst = tmp_path / name
        optstate_cli("convert", src, dst, "--format", fmt)
        assert hashes(optstate_cli, dst)["root"] == want["root"], fmt
        back = tmp_path / f"back_{fmt}.pt"
        optstate_cli("convert", dst, back, "--format", "torchsave")
        got = torch.load(back, weights_only=True)
        same_state(saved["optimizer"], got["optimizer"])
        for k, v in saved["model"].items():
            assert torch.equal(v, got["model"][k]), (fmt, k)
        # a fresh optimizer takes it and steps on exactly as the original
        m2, o2 = build(seed)
        m2.load_state_dict(got["model"])
        o2.load_state_dict(got["optimizer"])
        ref_model, ref_opt = build(seed)
        fresh = torch.load(src, weights_only=True)  # load_state_dict may keep the tensors it is given
        ref_model.load_state_dict(fresh["model"])
        ref_opt.load_state_dict(fresh["optimizer"])
        train(m2, o2, 2, seed, start=3)
        train(ref_model, ref_opt, 2, seed, start=3)
        for (n, a), b in zip(ref_model.named_parameters(), m2.parameters()):
            assert torch.equal(a, b), (fmt, n)
        same_state(ref_opt.state_dict(), o2.state_dict())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_models_dcp_loads_through_torch(tmp_path, optstate_cli, seed):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build(seed)
    train(model, opt, 3, seed)
    src = tmp_path / "src.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    optstate_cli("convert", src, tmp_path / "ckpt.dcp", "--format", "dcp")
    m2, o2 = build(seed)
    train(m2, o2, 1, seed + 50)  # state to be replaced
    msd, osd = get_state_dict(m2, o2)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt.dcp"))
    set_state_dict(m2, o2, model_state_dict=msd, optim_state_dict=osd)
    for (n, a), b in zip(model.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n
    same_state(opt.state_dict(), o2.state_dict())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_8bit_state_moves_to_bitsandbytes_and_torchao_and_back(tmp_path, optstate_cli, seed):
    """optstate.AdamW8bit on random shapes (around the 4096-element threshold, partial last blocks,
    a scalar, an empty param) saved natively, converted to bitsandbytes' and torchao's AdamW8bit
    files, loaded by those optimizers: every moment their rules quantize carries the same codes and
    scales (bitsandbytes keeps partial blocks, torchao whole blocks only, so its others read as our
    dequantized values), and converting each file back gives the state (bitsandbytes: the same hash;
    torchao: the same values, lr as its float32)."""
    bnb = pytest.importorskip("bitsandbytes")
    import optstate
    from torchao.optim import AdamW8bit as AoAdamW8bit

    g = torch.Generator().manual_seed(seed)
    shapes = [(), (0, 3), (4095,), (4096,), (4097,), (64, 64 + 1 + int(torch.randint(0, 60, (1,), generator=g))),
              (1 + int(torch.randint(0, 30, (1,), generator=g)), 256)]
    dtype = torch.bfloat16 if seed == 2 else torch.float32

    def make():
        return Bag(shapes, dtype, seed)

    model = make()
    opt = optstate.AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.01)
    for s in range(3):
        gg = torch.Generator().manual_seed(seed * 10 + s)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gg) * 1e-2).to(dtype)
        opt.step()
    optstate.save(tmp_path / "ckpt", model, opt)
    want = hashes(optstate_cli, tmp_path / "ckpt")["root"]

    optstate_cli("convert", tmp_path / "ckpt", tmp_path / "bnb.pt", "--format", "bitsandbytes")
    b = bnb.optim.AdamW8bit(make().parameters(), lr=1e-3)
    sd = torch.load(tmp_path / "bnb.pt")
    assert set(sd) == {"model", "optimizer"}  # with the weights the native checkpoint holds
    b.load_state_dict(sd["optimizer"])
    optstate_cli("convert", tmp_path / "ckpt", tmp_path / "ao.pt", "--format", "torchao")
    a = AoAdamW8bit(make().parameters(), lr=1e-3)
    a.load_state_dict(torch.load(tmp_path / "ao.pt", weights_only=False)["optimizer"])
    for p, pb, pa in zip(model.parameters(), b.param_groups[0]["params"], a.param_groups[0]["params"]):
        ours, sb, sa = opt.state[p], b.state[pb], a.state[pa]
        for k, n in (("exp_avg", "1"), ("exp_avg_sq", "2")):
            dense = ours.get(k)
            if dense is None:  # 8-bit here: bitsandbytes' codes and absmax are ours
                assert torch.equal(sb["state" + n].view(-1), ours[k + "_codes"].view(-1)), (p.shape, k)
                assert torch.equal(sb["absmax" + n], ours[k + "_absmax"]), (p.shape, k)
                t = sa[k]
                if hasattr(t, "codes"):  # whole blocks: torchao's too
                    assert torch.equal(t.codes.view(-1), ours[k + "_codes"].view(-1)) and torch.equal(
                        t.scale, ours[k + "_absmax"]), (p.shape, k)
                else:  # torchao keeps it dense: our dequantized values (in the param's dtype, as
                    # torch's load_state_dict casts a plain state tensor)
                    deq = optstate.ops.dequantize_blockwise(ours[k + "_codes"], ours[k + "_absmax"], 256,
                                                            "dynamic-signed" if n == "1" else "dynamic-unsigned")
                    assert torch.equal(t.view(-1), deq.to(p.dtype).view(-1)), (p.shape, k)
            else:
                assert torch.equal(sb["state" + n].view(-1).float(), dense.view(-1)), (p.shape, k)
                assert torch.equal(sa[k].view(-1), dense.to(p.dtype).view(-1)), (p.shape, k)
    # Back: bitsandbytes' file gives the state's own hash; torchao's the same values (its partial
    # blocks dequantized), and its lr as the float32 tensor torchao keeps, which diff names.
    optstate_cli("convert", tmp_path / "bnb.pt", tmp_path / "bnb.native")
    assert hashes(optstate_cli, tmp_path / "bnb.native")["root"] == want
    optstate_cli("convert", tmp_path / "ao.pt", tmp_path / "ao.native")
    d = json.loads(optstate_cli("diff", tmp_path / "ckpt", tmp_path / "ao.native", "--json", check=False).stdout)
    assert all(e["max_abs"] == 0 and e["outside"] == 0 for e in d["entries"].values()), d
    assert len(d["metadata"]) == 1 and "lr 0.001 vs 0.0010000000474974513" in d["metadata"][0], d["metadata"]
    assert optstate_cli("diff", tmp_path / "ckpt", tmp_path / "ao.native", "--rtol", "1e-7").returncode == 0
