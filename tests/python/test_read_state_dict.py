"""optstate.read_state_dict: any checkpoint optstate reads, returned as the state dicts PyTorch's own
APIs take (get_state_dict's form; torch's optimizer.state_dict() form for numbered params), checked
against what torch, torchao and DeepSpeed held, and by resuming from them with plain torch."""
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import set_state_dict

import optstate
from test_formats import make_dcp, st_load

ROOT = Path(__file__).resolve().parents[2]
TORCHSAVE = ROOT / "formats" / "torchsave" / "testdata"
DEEPSPEED = ROOT / "formats" / "deepspeed" / "testdata"


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))


def _adamw(model):
    return torch.optim.AdamW([{"params": [model[0].weight, model[2].weight]},
                              {"params": [model[0].bias, model[2].bias, model[1].weight, model[1].bias],
                               "weight_decay": 0.0, "lr": 3e-3}], lr=1e-3, amsgrad=True)


def _noted(fn, *args, **kwargs):
    """fn's result and the optstate.ReadNote warnings it gave (each once, whatever the filters)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, [w for w in caught if issubclass(w.category, optstate.ReadNote)]


def _steps(model, opt, seeds):
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_dcp_reads_as_get_state_dict_gave_it_and_plain_torch_resumes_bitwise(tmp_path):
    """A DCP of torch.optim.AdamW (two groups, amsgrad, BatchNorm buffers beside the weights):
    read_state_dict gives back get_state_dict's two dicts, tensor for tensor, and set_state_dict of
    them into a fresh model and AdamW continues bit for bit as the run that saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = _model()
    opt = _adamw(model)
    _steps(model, opt, range(3))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"))

    weights, optim = optstate.read_state_dict(tmp_path / "ck")
    assert weights.keys() == msd.keys()
    assert all(torch.equal(weights[k], v) and weights[k].dtype == v.dtype for k, v in msd.items())
    assert optim["state"].keys() == osd["state"].keys()
    for fqn, st in osd["state"].items():
        assert optim["state"][fqn].keys() == st.keys(), fqn
        for k, v in st.items():
            assert torch.equal(optim["state"][fqn][k], v) and optim["state"][fqn][k].dtype == v.dtype, (fqn, k)
    assert [g["params"] for g in optim["param_groups"]] == [g["params"] for g in osd["param_groups"]]
    for got, want in zip(optim["param_groups"], osd["param_groups"]):
        assert got == {k: v for k, v in want.items() if k != "params"} | {"params": got["params"]}

    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)  # other weights than the run's: the read must replace them
    fresh_opt = _adamw(fresh)
    set_state_dict(fresh, fresh_opt, model_state_dict=weights, optim_state_dict=optim)
    _steps(model, opt, range(3, 5))
    _steps(fresh, fresh_opt, range(3, 5))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_where_a_save_folder_led_comes_as_a_read_note_from_read_state_dict_and_load(tmp_path):
    """A training run's save folder (Megatron-LM's layout: iter_<N>/ per save, the tracker naming
    the newest) reads at the save its tracker names, as `optstate inspect` does; read_state_dict
    and load say so with one optstate.ReadNote warning, pointing at the caller's line, after a read
    that succeeded. The iteration folder itself reads with no note; a failed read warns nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = _model()
    opt = _adamw(model)
    _steps(model, opt, range(3))
    msd, osd = get_state_dict(model, opt)
    run = tmp_path / "checkpoints"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(run / "iter_0000003"))
    (run / "latest_checkpointed_iteration.txt").write_text("3")

    (want_weights, want_optim), noted = _noted(optstate.read_state_dict, run / "iter_0000003")
    assert noted == []
    (weights, optim), noted = _noted(optstate.read_state_dict, run)
    assert [str(w.message) for w in noted] == [
        f"optstate: {run}: Megatron-LM's save folder: latest_checkpointed_iteration.txt names iter_0000003/, "
        f"the iteration read"]
    assert noted[0].filename == __file__  # the caller's line, past gc_paused's wrapper
    assert weights.keys() == want_weights.keys() and all(torch.equal(weights[k], v) for k, v in want_weights.items())
    assert optim["state"].keys() == want_optim["state"].keys()

    fresh = _model()
    fresh_opt = optstate.FusedAdamW([{"params": [fresh[0].weight, fresh[2].weight]},
                                     {"params": [fresh[0].bias, fresh[2].bias, fresh[1].weight, fresh[1].bias],
                                      "weight_decay": 0.0, "lr": 3e-3}], lr=1e-3, amsgrad=True)
    _, noted = _noted(optstate.load, run, fresh, fresh_opt)
    assert [str(w.message) for w in noted] == [
        f"optstate: {run}: Megatron-LM's save folder: latest_checkpointed_iteration.txt names iter_0000003/, "
        f"the iteration read"]
    assert noted[0].filename == __file__
    for fqn, st in osd["state"].items():
        p = dict(fresh.named_parameters())[fqn]
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert torch.equal(fresh_opt.state[p][k], st[k]), (fqn, k)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))

    # a tracker that names no save: the read fails, no note
    (run / "latest_checkpointed_iteration.txt").write_text("9")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):
            optstate.read_state_dict(run)
    assert not [w for w in caught if issubclass(w.category, optstate.ReadNote)]


def test_torchaos_8bit_moments_come_back_as_torchaos_own_dequantize(tmp_path):
    """torchao's AdamW8bit in a DCP (tensor subclasses that only torchao rebuilds): the moments come
    back as plain fp32 tensors, bit for bit what torchao's OptimState8bit.dequantize() gave in the
    run that saved them; the weights as the model held them."""
    ck = make_dcp(tmp_path, "ao")
    ref = torch.load(str(ck) + ".ref.pt")
    weights, optim = optstate.read_state_dict(ck)
    names = {k.rsplit(".", 1)[0] for k in ref}
    assert set(optim["state"]) == names
    for k, v in ref.items():
        fqn, entry = k.rsplit(".", 1)
        got = weights[fqn] if entry == "param" else optim["state"][fqn][entry]
        assert got.dtype == torch.float32 and torch.equal(got, v.float()), k
    assert all(float(st["step"]) == 3.0 and st["step"].dtype == torch.float32 for st in optim["state"].values())
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    assert set(optim["param_groups"][0]) == set(plain.state_dict()["param_groups"][0])


def test_a_numbered_optimizer_pt_reads_in_torchs_own_form_and_loads_into_adamw():
    """A state_dict saved as torch.optim.AdamW gives it (params numbered, as Hugging Face's Trainer
    keeps optimizer.pt): read_state_dict keeps the numbers (ints), so optimizer.load_state_dict
    takes it; state and groups are the file's, as torch.load reads them."""
    src = TORCHSAVE / "torch_adamw_amsgrad.pt"
    want = torch.load(src)
    weights, optim = optstate.read_state_dict(src)
    assert weights == {}
    assert set(optim["state"]) == set(want["state"]) and all(isinstance(k, int) for k in optim["state"])
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(optim["state"][i][k], v), (i, k)
    assert [g["params"] for g in optim["param_groups"]] == [g["params"] for g in want["param_groups"]]
    for got, g in zip(optim["param_groups"], want["param_groups"]):
        for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
            assert got[k] == (tuple(g[k]) if k == "betas" else g[k]), k
    shapes = {i: st["exp_avg"].shape for i, st in want["state"].items()}
    params = [[torch.nn.Parameter(torch.zeros(shapes[i])) for i in g["params"]] for g in want["param_groups"]]
    opt = torch.optim.AdamW([{"params": ps} for ps in params])
    opt.load_state_dict(optim)
    for i, st in want["state"].items():
        assert torch.equal(opt.state_dict()["state"][i]["exp_avg_sq"], st["exp_avg_sq"]), i


def test_a_deepspeed_zero_checkpoint_reads_as_its_conversion(tmp_path, optstate_cli):
    """DeepSpeed ZeRO-2 over 2 ranks (each rank's partition of the flat fp32 groups): read with no
    DeepSpeed, by param name, the same values `optstate convert` writes (the fp32 masters as the
    weights)."""
    ck = DEEPSPEED / "zero2_world2"
    weights, optim = optstate.read_state_dict(ck)
    optstate_cli("convert", ck, tmp_path / "z.safetensors")
    conv = st_load(tmp_path / "z.safetensors")
    assert optim["state"] and {f"{fqn}.{k}" for fqn, st in optim["state"].items() for k in st if k != "step"} | \
        {f"{fqn}.param" for fqn in weights} == set(conv)
    for key, v in conv.items():
        fqn, entry = key.rsplit(".", 1)
        got = weights[fqn] if entry == "param" else optim["state"][fqn][entry]
        assert torch.equal(got, v), key
    assert {float(st["step"]) for st in optim["state"].values()} == {3.0}  # global_step3


def test_a_checkpoint_opened_once_reads_as_the_path_taking_ops_read_it(tmp_path):
    """optstate.load, verify and read_state_dict open a checkpoint once (torch.classes.optstate.
    Checkpoint) and read it several times: every method gives what its path-taking op gives, and
    again on a second call; a missing or damaged checkpoint raises at open, naming the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from optstate._ops import open_checkpoint
    model = _model()
    opt = _adamw(model)
    _steps(model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"))
    path = str(tmp_path / "ck")
    ops = optstate.ops

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and (a.is_meta or torch.equal(a, b))
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    ck = open_checkpoint(path)
    assert ck.path() == path and ck.format() == "dcp"
    for _ in range(2):
        for world, rank in ((1, 0), (2, 1)):
            assert same(ck.check_native_shard("fp32", 256, 4096, world, rank, True),
                        ops.check_native_shard(path, "fp32", 256, 4096, world, rank, True))
            assert same(ck.load_native_shard("8bit", 256, 16, world, rank, True, [], [], [], []),
                        ops.load_native_shard(path, "8bit", 256, 16, world, rank, True, [], [], [], []))
        for mode in ("meta", "check", "load"):
            got = ck.load_model_tensors(mode, [], [])
            assert got[0] and same(got, ops.load_model_tensors(path, mode, [], []))
        live = [msd[n].clone() for n in got[0]]
        changed = next(i for i, t in enumerate(live) if t.numel() > 1)  # a running mean, not the count
        live[changed].view(-1)[1] += 1
        assert ck.verify_model_tensors(got[0], live) == ops.verify_model_tensors(path, got[0], live) != []
    with pytest.raises(RuntimeError, match="no such file"):
        open_checkpoint(tmp_path / "gone")
    (tmp_path / "ck" / ".metadata").write_bytes(b"\x80\x02junk")
    with pytest.raises(RuntimeError, match=".metadata"):
        open_checkpoint(path)


def test_a_damaged_checkpoint_raises_naming_the_file(tmp_path):
    """A truncated optimizer.pt: RuntimeError naming the file, nothing returned."""
    bad = tmp_path / "optimizer.pt"
    data = (TORCHSAVE / "torch_adamw_amsgrad.pt").read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="optimizer.pt"):
        optstate.read_state_dict(bad)
    gone = tmp_path / "gone"
    shutil.copytree(DEEPSPEED / "zero2_world2", gone)
    (gone / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(RuntimeError, match="zero_pp_rank"):
        optstate.read_state_dict(gone)


# Every checkpoint of tests/data/ that a framework or another torch release wrote, with what it held
# beside it (<ck>.ref.safetensors: "<fqn>.<entry>" tensors, fp32; its "ref" metadata each param's
# step and group settings): Megatron-LM (torch_dist, zarr, legacy), NeMo 1, NeMo Automodel, NeMo RL
# (a folder per worker: its step_N/ one level down), nanotron, OLMo-core, Composer, Lightning, and
# torch 2.4-2.15 / torchao 0.5-0.18 (optimizer.pt, DCP, FSDP1 and FSDP2 per-rank files, torchao's
# AdamW8bit).
CORPORA = [ROOT / "tests" / "data" / "writers", ROOT / "tests" / "data" / "torch_versions"]
HELD = sorted(str(ref.relative_to(ROOT))[:-len(".ref.safetensors")]
              for corpus in CORPORA for ref in corpus.rglob("*.ref.safetensors"))


@pytest.mark.parametrize("ck", HELD)
def test_every_corpus_checkpoint_reads_as_its_writer_held_it(ck, optstate_cli):
    """read_state_dict of each gives what its writer held, bit for bit: every moment (torchao's as
    its dequantize() gives them) and every weight the reference keeps (the fp32 main params where
    the optimizer kept them, widened as the reference is), each param's step, its group's lr,
    betas, eps and weight decay; and what `optstate inspect` notes of the read (Megatron's groups,
    Composer's decay, ...) as optstate.ReadNote warnings, the same notes in the same order."""
    from safetensors import safe_open
    ref_path = ROOT / (ck + ".ref.safetensors")
    with safe_open(str(ref_path), "pt") as f:
        meta = json.loads(f.metadata()["ref"])
    ref = st_load(ref_path)
    (weights, optim), noted = _noted(optstate.read_state_dict, ROOT / ck)
    cli_notes = json.loads(optstate_cli("inspect", ROOT / ck, "--json").stdout)["read_notes"]
    assert [str(w.message) for w in noted] == [f"optstate: {ROOT / ck}: {n}" for n in cli_notes]
    state = {str(k): v for k, v in optim["state"].items()}
    moments = {f"{fqn}.{e}" for fqn, st in state.items() for e in st if e != "step"}
    assert moments == {k for k in ref if not k.endswith(".param")}
    for key, want in ref.items():
        fqn, entry = key.rsplit(".", 1)
        got = weights[fqn] if entry == "param" else state[fqn][entry]
        assert torch.equal(got.float(), want), key
        if entry != "param":
            assert got.dtype == torch.float32, key
    group_of = {str(n): g for g in optim["param_groups"] for n in g["params"]}
    assert set(meta) == set(group_of)
    for fqn, want in meta.items():
        if fqn in state:
            assert float(state[fqn]["step"]) == want["step"], fqn
        g = group_of[fqn]
        for field in ("lr", "betas", "eps", "weight_decay"):
            assert g[field] == pytest.approx(tuple(want[field]) if field == "betas" else want[field], rel=1e-7), \
                (fqn, field)


FSDP2_RESUME = """
import sys, torch, torch.distributed as dist
import optstate
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
dist.init_process_group("gloo")
def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 4))
    fully_shard(m)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05)
def steps(m, o, seeds):
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        m(torch.randn(8, 16, generator=g)).square().mean().backward()
        o.step()
        o.zero_grad()
m, o = build()
steps(m, o, range(3))
msd, osd = get_state_dict(m, o)
dcp.save({"model": msd, "optim": osd}, checkpoint_id=sys.argv[1])
fresh, fresh_opt = build()
with torch.no_grad():
    for p in fresh.parameters():
        p.mul_(0.5)  # other weights than the run's: the read must replace them
weights, optim = optstate.read_state_dict(sys.argv[1])  # whole, on every rank
set_state_dict(fresh, fresh_opt, model_state_dict=weights, optim_state_dict=optim,
               options=StateDictOptions(full_state_dict=True))
steps(m, o, range(3, 5))
steps(fresh, fresh_opt, range(3, 5))
same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(m.parameters(), fresh.parameters()))
print(f"rank {dist.get_rank()}: {'resumed bitwise' if same else 'DIFFERS'}")
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp2_ranks_resume_from_it_through_set_state_dict(tmp_path):
    """FSDP2 over 2 gloo ranks (a 33-row layer: shards of 17 and 16 rows): each rank reads the DCP
    whole with read_state_dict and hands it to set_state_dict as a full state dict, which shards
    it; two more steps are bit for bit those of the run that saved it. (torch's
    broadcast_from_rank0, with rank 0 alone reading, hangs on gloo in torch 2.13 with torch's own
    full state dicts too, so it is not used here.)"""
    from test_formats import run_script
    proc = run_script(tmp_path, FSDP2_RESUME, "fsdp2_resume.py", tmp_path / "ck", ranks=2)
    assert proc.stdout.count("resumed bitwise") == 2, proc.stdout + proc.stderr[-2000:]
