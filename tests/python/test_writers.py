"""Checkpoints that other training stacks' own writers produced (tests/data/writers/, each made by
the make_*.py beside it where that stack imports): read as the stack held the state, and converted
into what torch alone loads.

OLMo-core (OLMo 2 / OLMo 3's trainer) saves `stepN/model_and_optim/` as a flattened DCP through its
own storage writer, whose `.metadata` pickles OLMo-core's `_StorageInfo` class: without olmo_core
installed, torch's own reader cannot even open it.

NeMo Automodel saves `epoch_E_step_S/` as two parts: `optim/`, a DCP of the flattened optimizer state
(and the LR scheduler's), and `model/`, the model's weights as a DCP or, by default, in DCP's Hugging
Face storage (each rank's pieces in safetensors files of its own, no `.metadata`).

NeMo RL saves `step_N/` with its policy's two parts under `policy/`: with its default DTensor worker
(v2), NeMo Automodel's `optim/` and `model/` one level down (`policy/optimizer/optim/`,
`policy/weights/model/`); with the first worker (v1), `policy/optimizer/`, a DCP of the optimizer's
and the scheduler's state under "optim", beside `policy/weights/`, a DCP of the weights under "model".

Megatron-LM saves `iter_N/` through Megatron-Core's dist_checkpointing (torch_dist): a DCP keyed by
its model's sharded keys (layers stacked), the optimizer's moments as `optimizer.state.<entry>.<key>`,
its param groups (without members) and step in `common.pt` (from Megatron-Core 0.19 in the DCP's own
`common_state` item, and with --verify-integrity each file's SHA-256 in `integrity.json`): torch alone
sees no optimizer in it.

nanotron saves `checkpoints/<step>/optimizer/` as torch.save of each pipeline stage's (under ZeRO-1,
each data-parallel rank's) NamedOptimizer state_dict: params numbered per file and named by an added
'names' dict, their fp32 weights under 'gradient_accumulator', ZeRO-1's 1-D runs placed by
`optimizer_config.json`.
"""
import json
import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from test_formats import hashes, run_err, run_script, st_load
from test_torch_versions import reads_as_held

CORPUS = Path(__file__).resolve().parents[1] / "data" / "writers"
OLMO = CORPUS / "olmo-core-3.0.0_torch-2.13.0" / "model_and_optim"
MEGATRON = CORPUS / "megatron-core-0.16.1_torch-2.13.0"
MEGATRON_013 = CORPUS / "megatron-core-0.13.1_torch-2.13.0"
MEGATRON_015 = CORPUS / "megatron-core-0.15.3_torch-2.13.0"
MEGATRON_09 = CORPUS / "megatron-core-0.9.0_torch-2.13.0"
MEGATRON_019 = CORPUS / "megatron-core-0.19.0_torch-2.13.0"
NANOTRON = CORPUS / "nanotron-2411b02_torch-2.13.0"
NEMO = CORPUS / "nemo-automodel-0.7.0_torch-2.13.0"
NEMO_HF_NOTE = "the tensors stored in safetensors files carry no checksums"
NEMO_RL = CORPUS / "nemo-rl-0.6.0_torch-2.13.0"


def ref_of(ck):
    from safetensors import safe_open
    from safetensors.torch import load_file
    path = Path(str(ck) + ".ref.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), json.loads(meta["ref"])


def test_an_olmo_core_checkpoint_reads_as_olmo_core_held_it(tmp_path, optstate_cli):
    """validate passes with every checksum checked; the fp32 conversion is, bit for bit, what
    OLMo-core's SkipStepAdamW held (gathered by torch over the two FSDP2 ranks, a 33-row layer
    sharded 17 + 16); steps and both groups' hyperparameters are its own."""
    ref, meta = ref_of(OLMO)
    info = reads_as_held(tmp_path, optstate_cli, OLMO, ref, meta)
    assert info["format"] == "dcp" and len(info["param_groups"]) == 2, info["param_groups"]
    assert sorted(g["weight_decay"] for g in info["param_groups"]) == [0.0, 0.1]


@pytest.mark.parametrize("model_format", ["torch_save", "safetensors"])
def test_a_nemo_automodel_checkpoint_reads_as_nemo_automodel_held_it(tmp_path, optstate_cli, model_format):
    """The step folder NeMo Automodel's Checkpointer saved (FSDP2, two ranks, a 33-row layer sharded
    17 + 16) reads as one: the fp32 conversion is, bit for bit, what the run held, weights included,
    whether model/ is a DCP (model_save_format torch_save) or DCP's Hugging Face storage (safetensors,
    NeMo's default: no .metadata, each rank's pieces placed by DCP_SHARDING_INFO); validate checks
    every CRC-32 the DCPs stored and says the safetensors weights have none; inspect says what it read
    from where; the LR scheduler's items are named as not read. Both hash alike, and optim/ alone is the same optimizer state without
    the weights."""
    ck = NEMO / f"{model_format}_epoch_0_step_2"
    assert (ck / "optim" / ".metadata").exists()
    assert (ck / "model" / ".metadata").exists() == (model_format == "torch_save")
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta,
                         checksums=True if model_format == "torch_save" else NEMO_HF_NOTE)
    assert info["format"] == "dcp" and info["ranks"] == 2, info
    assert sorted(g["weight_decay"] for g in info["param_groups"]) == [0.0, 0.1]
    assert info["not_read"] == ["sched (7 items)"], info["not_read"]
    part = "a DCP" if model_format == "torch_save" else "DCP's Hugging Face storage: safetensors files, no checksums"
    assert info["read_notes"] == [f"NeMo Automodel's folder: the optimizer's DCP optim/ read with the model's weights "
                                  f"in model/ ({part})"], info["read_notes"]
    both = {f: hashes(optstate_cli, NEMO / f"{f}_epoch_0_step_2") for f in ("torch_save", "safetensors")}
    assert both["torch_save"] == both["safetensors"]
    alone = hashes(optstate_cli, ck / "optim")
    assert alone["entries"] == {k: v for k, v in both["torch_save"]["entries"].items() if not k.endswith(".param")}
    # a training run's folder: a write never replaces it
    copy = tmp_path / "run"
    shutil.copytree(ck, copy)
    r = optstate_cli("convert", tmp_path / "fp32.safetensors", copy, "--format", "dcp", "--overwrite", check=False)
    assert r.returncode == 2 and "never replaces" in r.stderr, r.stderr
    assert hashes(optstate_cli, copy) == both["torch_save"]


@pytest.mark.parametrize("worker", ["dtensor_v2", "dtensor_v1"])
def test_a_nemo_rl_checkpoint_reads_as_nemo_rl_held_it(tmp_path, optstate_cli, worker):
    """The step folder NeMo RL's CheckpointManager and DTensor policy worker saved (FSDP2 over a
    dp x tp mesh of 2 x 1, a 33-row layer sharded 17 + 16, a warm-up SequentialLR) reads as one,
    from step_N/ or from its policy/: the fp32 conversion is, bit for bit, what the run held, weights
    included, with the v2 worker's safetensors weights (named as carrying no checksums) and the v1
    worker's DCP of weights; the scheduler's items are named as not read; inspect says what it read
    from where. Both workers' folders hash alike, the optimizer's part alone is the same state
    without the weights, a step_N/ that also holds a critic's value/ is not taken for the policy's
    (the error names both), and a write never replaces the folder."""
    step = NEMO_RL / worker / "step_2"
    v2 = worker == "dtensor_v2"
    optimizer, weights = ("optimizer/optim", "weights/model") if v2 else ("optimizer", "weights")
    assert (step / "policy" / optimizer / ".metadata").exists()
    assert (step / "policy" / weights / ".metadata").exists() != v2
    ref, meta = ref_of(step)
    part = "DCP's Hugging Face storage: safetensors files, no checksums" if v2 else "a DCP"
    for ck, whose, prefix in ((step, "NeMo RL's", "policy/"), (step / "policy", "NeMo RL's policy/ (or value/)", "")):
        case = tmp_path / f"read_{ck.name}"
        case.mkdir()
        info = reads_as_held(case, optstate_cli, ck, ref, meta, checksums=NEMO_HF_NOTE if v2 else True)
        assert info["format"] == "dcp" and info["ranks"] == 2, info
        assert sorted(g["weight_decay"] for g in info["param_groups"]) == [0.0, 0.1]
        assert info["not_read"] == [f"{'' if v2 else 'optim.'}sched (20 items)"], info["not_read"]
        assert info["read_notes"] == [f"{whose} folder: the optimizer's DCP {prefix}{optimizer}/ read with the "
                                      f"model's weights in {prefix}{weights}/ ({part})"], info["read_notes"]
    both = {w: hashes(optstate_cli, NEMO_RL / w / "step_2") for w in ("dtensor_v2", "dtensor_v1")}
    assert both["dtensor_v2"] == both["dtensor_v1"]
    assert hashes(optstate_cli, step / "policy") == both["dtensor_v2"]
    alone = hashes(optstate_cli, step / "policy" / optimizer)
    assert alone["entries"] == {k: v for k, v in both["dtensor_v2"]["entries"].items() if not k.endswith(".param")}
    # with a critic's value/ beside policy/, step_N/ is two models' folder: pass one of them
    run = tmp_path / "step_2"
    shutil.copytree(step, run)
    shutil.copytree(step / "policy", run / "value")
    err = run_err(optstate_cli, "inspect", run)
    assert "it holds policy/ (dcp), value/ (dcp): pass one of them" in err, err
    assert hashes(optstate_cli, run / "value") == both["dtensor_v2"]
    # a training run's folder: a write never replaces it
    shutil.rmtree(run / "value")
    r = optstate_cli("convert", tmp_path / "read_policy" / "fp32.safetensors", run, "--format", "dcp", "--overwrite",
                     check=False)
    assert r.returncode == 2 and "never replaces" in r.stderr, r.stderr
    assert hashes(optstate_cli, run) == both["dtensor_v2"]


def nemo_hf_copy(tmp_path):
    ck = tmp_path / "epoch_0_step_2"
    shutil.copytree(NEMO / "safetensors_epoch_0_step_2", ck)
    return ck, sorted((ck / "model").glob("shard-*.safetensors"))


def rewrite_safetensors(path, edit):
    """Rewrites a safetensors file with `edit(header dict)` applied to its JSON header (data kept)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def test_a_nemo_automodel_checkpoint_whose_safetensors_weights_are_damaged_is_refused_naming_them(tmp_path,
                                                                                                optstate_cli):
    """What the Hugging Face storage's files may say wrongly is caught, naming the file and tensor:
    a rank's file missing (the weight's pieces end at 17 of its 33 rows: not its state's shape),
    a piece placed where another already is, offsets of another rank count, sharding info that is
    not JSON, a tensor it does not place, a file cut short. Nothing is written by a convert."""
    cases = {
        "missing": lambda files: files[1].unlink(),
        "twice": lambda files: rewrite_safetensors(files[1], lambda h: h["__metadata__"].update(
            DCP_SHARDING_INFO=h["__metadata__"]["DCP_SHARDING_INFO"].replace("[17, 0]", "[0, 0]"))),
        "axes": lambda files: rewrite_safetensors(files[0], lambda h: h["__metadata__"].update(
            DCP_SHARDING_INFO=h["__metadata__"]["DCP_SHARDING_INFO"].replace('"0.bias": {"saved_offsets": [0]}',
                                                                             '"0.bias": {"saved_offsets": [0, 0]}'))),
        "not_json": lambda files: rewrite_safetensors(files[0], lambda h: h["__metadata__"].update(
            DCP_SHARDING_INFO="{not json")),
        "unplaced": lambda files: rewrite_safetensors(files[0], lambda h: h["__metadata__"].update(
            DCP_SHARDING_INFO=json.dumps({k: v for k, v in json.loads(h["__metadata__"]["DCP_SHARDING_INFO"]).items()
                                          if k != "2.weight"}))),
        "truncated": lambda files: files[0].write_bytes(files[0].read_bytes()[:-8]),
    }
    want = {
        "missing": "model weight's shape [17] differs from its state's [33]",
        "twice": "a second piece at offsets [0, 0]",
        "axes": "1 axes",
        "not_json": "DCP_SHARDING_INFO",
        "unplaced": "tensor '2.weight': not placed by DCP_SHARDING_INFO",
        "truncated": "shard-00001-model-00001-of-00001.safetensors",
    }
    for name, damage in cases.items():
        case = tmp_path / name
        case.mkdir()
        ck, files = nemo_hf_copy(case)
        damage(files)
        proc = optstate_cli("validate", ck, check=False)  # 1: a finding (a shape), 2: unreadable
        err = proc.stdout + proc.stderr
        assert proc.returncode in (1, 2) and want[name] in err, (name, proc.returncode, err)
        assert re.search(r"shard-0000[12]-model|'[02]\.(weight|bias)'", err), (name, err)  # the file or tensor
        run_err(optstate_cli, "convert", ck, case / "out.safetensors")
        assert not (case / "out.safetensors").exists(), name


TORCH_ALONE = textwrap.dedent("""
    # What a user with torch alone (no olmo_core) does with a DCP: dcp.load into the state dicts of
    # make_olmo_core.py's model and a torch.optim.AdamW of its groups, flattened as OLMo-core saves
    # them, then set_state_dict and a step. Prints JSON: the load's error, if any, whether every
    # moment and weight equals the reference, the groups' settings, and whether the step ran.
    import json, sys, torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    path, ref_path = sys.argv[1:3]
    assert "olmo_core" not in sys.modules
    ref = load_file(ref_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": mats, "weight_decay": 0.5}, {"params": vecs, "weight_decay": 0.5}], lr=0.5)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()  # state to load into
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    states = {"model": msd, "optim": osd}
    try:
        dcp.load(states, checkpoint_id=path)
    except BaseException as e:  # DCP's CheckpointException carries each rank's error
        print(json.dumps({"error": f"{type(e).__name__}: {e}"[-400:]}))
        sys.exit(0)
    set_state_dict(model, opt, model_state_dict=states["model"], optim_state_dict=states["optim"], options=options)
    equal = True
    for name, p in model.named_parameters():
        equal &= bool(torch.equal(p.detach(), ref[f"{name}.param"]))
        for k in ("exp_avg", "exp_avg_sq"):
            equal &= bool(torch.equal(opt.state[p][k], ref[f"{name}.{k}"]))
    steps = sorted({float(opt.state[p]["step"]) for p in model.parameters()})
    groups = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in opt.param_groups]
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    stepped = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(json.dumps({"error": None, "equal": equal, "steps": steps, "groups": groups, "stepped": stepped}))
""")


@pytest.mark.parametrize("args", [(), ("--world-size", "3")], ids=["dcp", "resharded"])
def test_an_olmo_core_checkpoint_converts_to_a_dcp_torch_alone_resumes_from(tmp_path, optstate_cli, args):
    """torch's reader cannot open OLMo-core's checkpoint without olmo_core (its `.metadata`
    unpickles OLMo-core's class); optstate's DCP of it loads with dcp.load + set_state_dict into a
    torch.optim.AdamW, each moment and weight what OLMo-core held, both groups' settings kept
    (weight decay on the matrices only), and a step runs. (OLMo-core's own
    load_model_and_optim_state takes the written DCP too, on 2 or 3 ranks: checked by hand where
    olmo_core imports, as it is not in the suite's venv.)"""
    ref_path = str(OLMO) + ".ref.safetensors"
    ref, meta = ref_of(OLMO)
    source = json.loads(run_script(tmp_path, TORCH_ALONE, "torch_alone.py", OLMO, ref_path).stdout)
    assert source["error"] and "olmo_core" in source["error"], source
    out = tmp_path / "model_and_optim"
    optstate_cli("convert", OLMO, out, "--format", "dcp", *args)
    got = json.loads(run_script(tmp_path, TORCH_ALONE, "torch_alone.py", out, ref_path).stdout)
    assert got["error"] is None, got
    assert got["equal"] and got["stepped"], got
    assert got["steps"] == sorted({float(m["step"]) for m in meta.values()}), got
    want = sorted((m["weight_decay"], m["lr"], tuple(m["betas"]), m["eps"]) for m in meta.values())
    have = sorted((g["weight_decay"], g["lr"], tuple(g["betas"]), g["eps"]) for g in got["groups"])
    assert sorted(set(have)) == sorted(set(want)), (have, want)


LIGHTNING = CORPUS / "lightning-2.6.6_torch-2.13.0" / "epoch=0-step=3.ckpt"


def test_a_lightning_fsdp_sharded_checkpoint_reads_as_torch_gathers_it(tmp_path, optstate_cli):
    """Lightning's FSDP checkpoint folder (a DCP of "model" and "optimizer_0", keyed by fqn, beside
    meta.pt) reads as torch itself reads it back (dcp_to_torch_save); inspect names meta.pt."""
    ref, meta = ref_of(LIGHTNING)
    reads_as_held(tmp_path, optstate_cli, LIGHTNING, ref, meta)
    assert "meta.pt (beside the DCP: Lightning's trainer state)" in optstate_cli("inspect", LIGHTNING).stdout


def test_a_dcp_written_from_a_lightning_folder_keeps_meta_pt(tmp_path, optstate_cli):
    """Lightning takes a folder for its checkpoint only with meta.pt in it (its loops, callbacks,
    LR schedulers): DCP -> DCP copies it byte for byte and says so; another format names it as not
    in DST. (Trainer.fit(ckpt_path=...) resumes from the written folder as from the source, to the
    same state two steps on: checked by hand with make_lightning.py's set-up, as lightning is not in
    the suite's venv.)"""
    out = tmp_path / "epoch=0-step=3.ckpt"
    proc = optstate_cli("convert", LIGHTNING, out, "--format", "dcp")
    assert "carried unchanged: meta.pt (beside the DCP: Lightning's trainer state)" in proc.stdout, proc.stdout
    assert (out / "meta.pt").read_bytes() == (LIGHTNING / "meta.pt").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    meta = torch.load(out / "meta.pt", weights_only=False)
    assert meta["global_step"] == 3 and "loops" in meta, sorted(meta)
    assert hashes_root(optstate_cli, out) == hashes_root(optstate_cli, LIGHTNING)
    proc = optstate_cli("convert", LIGHTNING, tmp_path / "plain.safetensors")
    assert "also holds meta.pt (beside the DCP: Lightning's trainer state)" in proc.stderr + proc.stdout


def hashes_root(optstate_cli, path):
    return json.loads(optstate_cli("hash", path, "--json").stdout)["root"]


MAKE_FOLDER = textwrap.dedent("""
    # A DCP saved into a folder that holds a run's other files: a config beside it, a folder of
    # tokenizer files, and a hidden file (another writer's staging), as any loop may leave them.
    import os, sys, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write('{"lr": 0.001}')
    os.makedirs(os.path.join(out, "tokenizer"))
    with open(os.path.join(out, "tokenizer", "vocab.txt"), "w") as f:
        f.write("a b c")
    with open(os.path.join(out, ".tmp-staging"), "w") as f:
        f.write("x")
    os.symlink("/", os.path.join(out, "root_link"))  # a hostile folder's: never followed
""")


def test_what_a_dcp_folder_holds_beside_the_dcp_is_carried_by_dcp_to_dcp(tmp_path, optstate_cli):
    """Files and folders beside the DCP are named by inspect and copied by a DCP write from it
    (resharded too), links as links, never followed; hidden names are neither."""
    src = tmp_path / "src"
    run_script(tmp_path, MAKE_FOLDER, "make_folder.py", src)
    text = optstate_cli("inspect", src).stdout
    assert "config.json (beside the DCP)" in text and "tokenizer (beside the DCP)" in text
    assert ".tmp-staging" not in text
    out = tmp_path / "out"
    optstate_cli("convert", src, out, "--format", "dcp", "--world-size", "3")
    assert (out / "config.json").read_text() == '{"lr": 0.001}'
    assert (out / "tokenizer" / "vocab.txt").read_text() == "a b c"
    assert not (out / ".tmp-staging").exists()
    assert (out / "root_link").is_symlink() and os.readlink(out / "root_link") == "/"  # copied as a link
    assert hashes_root(optstate_cli, out) == hashes_root(optstate_cli, src)


COMPOSER = CORPUS / "mosaicml-0.32.1_torch-2.13.0" / "ep0-ba3-rank0.pt"


def test_a_composer_checkpoint_reads_with_decoupled_adamws_weight_decay_as_adamws(tmp_path, optstate_cli):
    """Composer's checkpoint ({"state": {"model", "optimizers": {"DecoupledAdamW": ...}}, "rng"})
    reads as Composer held the state; DecoupledAdamW's weight decay (not scaled by lr) is read as the
    AdamW weight decay of the same update, divided by the group's initial_lr, and inspect says so.
    (A step of torch.optim.AdamW from the conversion below equals DecoupledAdamW's from the file,
    to an ulp of the weights: checked by hand where composer imports, as it is not in the suite's
    venv.)"""
    ref, meta = ref_of(COMPOSER)
    info = reads_as_held(tmp_path, optstate_cli, COMPOSER, ref, meta)
    assert sorted(g["weight_decay"] for g in info["param_groups"]) == [0.0, pytest.approx(0.01, rel=1e-12)]
    assert info["read_notes"] == ["param group 0: weight_decay 1e-05 is Composer's DecoupledAdamW's (not scaled by "
                                  "lr), read as AdamW's 0.01 (divided by initial_lr 0.001)"], info["read_notes"]
    assert "['state']['schedulers']" in info["not_read"] and "['rng']" in info["not_read"]
    # Written as torch.save, it is torch.optim.AdamW's plain {"model", "optimizer"}, not Composer's
    # file carried (whose DecoupledAdamW would take 0.01 for its own weight decay).
    out = tmp_path / "plain.pt"
    proc = optstate_cli("convert", COMPOSER, out)
    assert "Composer's DecoupledAdamW's (not scaled by lr)" in proc.stderr, proc.stderr
    sd = torch.load(out, weights_only=True)
    assert sorted(sd) == ["model", "optimizer"]
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    model.load_state_dict(sd["model"])
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": mats}, {"params": vecs}], lr=1.0)
    opt.load_state_dict(sd["optimizer"])
    assert [g["weight_decay"] for g in opt.param_groups] == [pytest.approx(0.01, rel=1e-12), 0.0]
    assert [g["initial_lr"] for g in opt.param_groups] == [0.001, 0.001]
    for name, p in model.named_parameters():
        assert torch.equal(opt.state[p]["exp_avg"], ref[f"{name}.exp_avg"]), name


def test_composers_decoupled_adamw_without_initial_lr_is_refused_and_in_a_dcp_reads_as_from_its_file(
        tmp_path, optstate_cli):
    """Without a positive initial_lr DecoupledAdamW's decay is weight_decay at any lr, which no
    AdamW weight decay is: refused naming the group. A DCP of it (Composer's sharded checkpoint
    keys its optimizer by class too) reads as its torch.save file does, the decay AdamW's
    equivalent, and DCP -> DCP writes DecoupledAdamW's own back; a DCP of Composer's
    torch.optim.AdamW reads its decay as it is."""
    import torch.distributed.checkpoint as dcp
    ck = torch.load(COMPOSER, weights_only=False)
    sd = ck["state"]["optimizers"]["DecoupledAdamW"]
    for g in sd["param_groups"]:
        del g["initial_lr"]
    torch.save(ck, tmp_path / "no_initial_lr.pt")
    err = run_err(optstate_cli, "inspect", tmp_path / "no_initial_lr.pt")
    assert "param group 0: Composer's DecoupledAdamW with weight_decay 1e-05 and no positive 'initial_lr'" in err, err
    model = {k: v for k, v in ck["state"]["model"].items()}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    for cls, decay in (("DecoupledAdamW", pytest.approx(0.01, rel=1e-12)), ("AdamW", 1e-05)):
        ck2 = torch.load(COMPOSER, weights_only=False)
        state = {"model": model, "optimizers": {cls: ck2["state"]["optimizers"]["DecoupledAdamW"]}}
        path = tmp_path / f"dcp_{cls}"
        dcp.save({"state": state}, checkpoint_id=path)
        info = json.loads(optstate_cli("inspect", path, "--json").stdout)
        assert sorted(g["weight_decay"] for g in info["param_groups"]) == [0.0, decay]
        assert info["params"] and all("param" in p["entries"] for p in info["params"].values()), info["params"]
        if cls == "DecoupledAdamW":
            assert info["read_notes"] == ["param group 0: weight_decay 1e-05 is Composer's DecoupledAdamW's (not "
                                          "scaled by lr), read as AdamW's 0.01 (divided by initial_lr 0.001)"]
            optstate_cli("convert", path, tmp_path / "copy", "--format", "dcp")
            dcp_to_torch_save(tmp_path / "copy", tmp_path / "copy.pt")
            groups = torch.load(tmp_path / "copy.pt", weights_only=False)["state"]["optimizers"][cls]["param_groups"]
            assert sorted(g["weight_decay"] for g in groups) == [0.0, 1e-05], groups



MAKE_SAFETENSORS_DCP = textwrap.dedent("""
    # dcp.save through FileSystemWriter(serialization_format=SAFETENSORS) of get_state_dict under
    # FSDP2 on the ranks (a 33-row layer split 17 + 16), and what the run held (gathered by torch,
    # full_state_dict) in <out>.ref.pt.
    import sys, torch, torch.distributed as dist, torch.nn as nn
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 5))
    for m in [model[0], model[2], model]:
        fully_shard(m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS))
    fmsd, fosd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({"model": fmsd, "optim": fosd}, out + ".ref.pt")
""")

RESUME_FROM_DCP = textwrap.dedent("""
    # torch alone: dcp.load + set_state_dict of a DCP into MAKE_SAFETENSORS_DCP's model and AdamW on
    # one process; prints whether every weight and moment equals the reference's (or the load's error).
    import json, sys, torch, torch.nn as nn
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    path, ref = sys.argv[1], torch.load(sys.argv[2], weights_only=False)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    try:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    except BaseException as e:  # DCP's CheckpointException (a BaseException) carries the reader's error
        print(json.dumps({"error": type(e).__name__}))
        sys.exit(0)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    equal = all(torch.equal(p.detach(), ref["model"][n]) for n, p in model.named_parameters())
    for n, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            equal &= bool(torch.equal(opt.state[p][k], ref["optim"]["state"][n][k]))
    print(json.dumps({"equal": equal, "lr": opt.param_groups[0]["lr"]}))
""")


def test_a_dcp_saved_as_safetensors_reads_and_converts_to_one_torch_loads(tmp_path, optstate_cli):
    """FileSystemWriter(serialization_format=SAFETENSORS) stores each rank's tensors as one
    safetensors blob after its bytes items, every tensor chunk's offset in the .metadata the blob's
    start: torch's own reader cannot take it back (checked here). optstate reads the tensors from the
    blobs (placed by DCP_SHARDING_INFO): under FSDP2 on two ranks, every weight and moment as the run
    held them; validate says those carry no checksums; the conversion to a DCP is one torch's
    dcp.load + set_state_dict resume from, bit for bit. A blob that no longer holds a chunk, or holds
    it with another shape, is refused naming the file and item."""
    ck = tmp_path / "st"
    run_script(tmp_path, MAKE_SAFETENSORS_DCP, "make_st.py", ck, ranks=2)
    ref = torch.load(str(ck) + ".ref.pt", weights_only=False)
    unread = json.loads(run_script(tmp_path, RESUME_FROM_DCP, "resume.py", ck, str(ck) + ".ref.pt").stdout)
    assert "error" in unread, unread  # torch's own reader
    validated = optstate_cli("validate", ck).stdout
    assert "the tensors stored in safetensors files carry no checksums; every torch.save record's CRC-32 verified" \
        in validated, validated
    info = json.loads(optstate_cli("inspect", ck, "--json", "--no-stats").stdout)
    assert info["ranks"] == 2 and sorted(info["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    optstate_cli("convert", ck, tmp_path / "fp32.safetensors")
    got = st_load(tmp_path / "fp32.safetensors")
    for n, w in ref["model"].items():
        assert torch.equal(got[f"{n}.param"], w), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"{n}.{k}"], ref["optim"]["state"][n][k]), (n, k)
    fixed = tmp_path / "fixed"
    optstate_cli("convert", ck, fixed, "--format", "dcp")
    resumed = json.loads(run_script(tmp_path, RESUME_FROM_DCP, "resume.py", fixed, str(ck) + ".ref.pt").stdout)
    assert resumed == {"equal": True, "lr": 1e-2}, resumed
    # damaged: rank 1's blob places the weight's piece at other offsets, or gives it another shape
    def moved(h):
        info = json.loads(h["__metadata__"]["DCP_SHARDING_INFO"])
        info["model.0.weight"]["saved_offsets"] = [16, 0]
        h["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)

    def reshaped(h):
        h["model.0.weight"]["shape"] = [8, 32]

    for name, edit in {"moved": moved, "reshaped": reshaped}.items():
        bad = tmp_path / name
        shutil.copytree(ck, bad)
        data = (bad / "__1_0.distcp").read_bytes()
        at = next(p for p in range(len(data) - 9) if data[p + 8:p + 10] == b'{"' and
                  p + 8 + int.from_bytes(data[p:p + 8], "little") < len(data) and
                  data[p + 8 + int.from_bytes(data[p:p + 8], "little") - 1:][:1] in (b"}", b" "))
        n = int.from_bytes(data[at:at + 8], "little")
        header = json.loads(data[at + 8:at + 8 + n])
        edit(header)
        text = json.dumps(header, separators=(",", ":")).encode()
        assert len(text) <= n, name
        (bad / "__1_0.distcp").write_bytes(data[:at + 8] + text + b" " * (n - len(text)) + data[at + 8 + n:])
        proc = optstate_cli("validate", bad, check=False)
        err = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "__1_0.distcp (the safetensors blob at byte" in err and \
            "'model.0.weight'" in err, (name, err)
        run_err(optstate_cli, "convert", bad, tmp_path / f"{name}.safetensors")
        assert not (tmp_path / f"{name}.safetensors").exists()


@pytest.mark.parametrize("run", ["tp2", "dp2_distopt", "moe_ep2", "moe_ep2_plain"])
def test_a_megatron_checkpoint_reads_as_megatron_held_it(tmp_path, optstate_cli, run):
    """Megatron-LM's torch_dist checkpoint of Megatron-Core's GPTModel (layers stacked along a
    leading axis, bf16 weights), tensor parallel 2 with the mixed-precision optimizer (its fp32
    copies as `fp32_param`), or data parallel 2 with the distributed optimizer saved
    fully_reshardable (its fp32 main params as `param`), or a mixture of experts under expert
    parallelism 2 (a chain of two optimizers, the experts' its second, the experts stacked along a
    second axis; the distributed optimizer's items unprefixed as Megatron-LM saves them, the
    mixed-precision one's prefixed `chained_<i>.`): validate passes
    with every checksum checked (column shards' chunks read in pieces too), the fp32 conversion is
    bit for bit what Megatron's optimizer held (the main params as the params), and each key's group
    is the one Megatron put its params in, though common.pt keeps no group's members: Megatron-Core's
    standard groups, said as such."""
    ck = MEGATRON / run
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    decays = [0.1, 0.0] + ([0.1] if run.startswith("moe") else [])  # the experts' optimizer: one group
    assert [g["weight_decay"] for g in info["param_groups"]] == decays
    assert any("Megatron saves no param group's members" in n for n in info["read_notes"]), info["read_notes"]
    assert any("common.pt: args, checkpoint_version, iteration, opt_param_scheduler" in n for n in info["not_read"])
    assert any(n.startswith("the model's bf16 weights") for n in info["not_read"]), info["not_read"]
    unprefixed = any("saved its items unprefixed" in n for n in info["read_notes"])
    assert unprefixed == (run == "moe_ep2"), info["read_notes"]
    # plain DCP from it (Megatron's layout is not written back): the same state, nothing of Megatron's
    out = tmp_path / "plain_dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert not (out / "common.pt").exists() and not (out / "metadata.json").exists()
    assert optstate_cli("diff", ck, out).returncode == 0


@pytest.mark.parametrize("run", ["dp2_distopt", "tp2_dp2_distopt", "moe_ep2", "tp2_dp2_distopt_optim_only"])
def test_megatron_core_0_13s_distributed_optimizer_checkpoint_reads_as_megatron_held_it(tmp_path, optstate_cli, run):
    """Megatron-Core up to 0.13 saved the distributed optimizer `fully_sharded_model_space` (its
    default; Megatron-LM's with --ckpt-fully-parallel-save, NeMo's with parallel_save_optim): per
    key, each data-parallel rank's flattened range of its tensor-parallel chunk, in an item of shape
    [*chunks, chunk numel] whose real shape only .metadata's `mcore_data` holds (torch cannot even
    unpickle that .metadata without megatron installed). Data parallel 2 (3 layers: the ranks'
    halves of the buffer split a layer's linear_fc1 weight in two ranges), and tensor parallel 2 x
    data parallel 2 (column- and row-parallel chunks), and a mixture of experts under expert
    parallelism 2 (a chain of two optimizers, its items prefixed `chained_<i>.` as 0.13 saves them),
    and the tensor-parallel one without the model's items (verl's optimizer/dist_ckpt/: the groups
    then told from the flattened items alone): bit for bit what Megatron's optimizer held, the fp32
    main params as the params, in Megatron-Core's standard groups."""
    from torch.distributed.checkpoint import FileSystemReader
    ck = MEGATRON_013 / run
    with pytest.raises(ModuleNotFoundError, match="megatron"):
        FileSystemReader(str(ck)).read_metadata()
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0] + ([0.1] if run == "moe_ep2" else [])
    fc1 = {"dp2_distopt": ("decoder.layers.mlp.linear_fc1.weight", [3, 64, 16]),
           "tp2_dp2_distopt": ("decoder.layers.mlp.linear_fc1.weight", [2, 32, 8]),
           "tp2_dp2_distopt_optim_only": ("decoder.layers.mlp.linear_fc1.weight", [2, 32, 8]),
           "moe_ep2": ("decoder.layers.mlp.experts.experts.linear_fc1.weight", [2, 2, 32, 8])}[run]
    assert info["params"][fc1[0]]["shape"] == fc1[1]
    model_beside = any(n.startswith("the model's bf16 weights, the optimizer's fp32 main params") for n in info["not_read"])
    assert model_beside == (run != "tp2_dp2_distopt_optim_only"), info["not_read"]
    out = tmp_path / "plain_dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0
    assert FileSystemReader(str(out)).read_metadata() is not None  # torch alone reads optstate's


@pytest.mark.parametrize("run", ["zarr_tp2", "zarr_fp32_dp2", "zarr_dp2_distopt", "zarr_tp2_dp2_distopt", "zarr_moe_ep2",
                                 "nemo1_zarr_tp2", "nemo1_zarr_tp2_dp2_distopt"])
def test_megatrons_zarr_backend_checkpoint_reads_as_megatron_held_it(tmp_path, optstate_cli, run):
    """Megatron-Core's zarr backend (`--ckpt-format zarr`, NeMo 1.x's default dist_ckpt_format),
    saved by Megatron-Core 0.9 over apex's FusedAdam (the step in each param group): each sharded
    key a zarr array of its whole tensor (bf16 as tensorstore's numpy bfloat16), one raw file per
    tensor-parallel/layer chunk; the distributed optimizer's fully_sharded_model_space ranges
    written into those arrays (zarr's `.sync` lock folders beside them). Tensor parallel 2 with the
    mixed-precision optimizer, fp32 data parallel 2 with the plain one, the distributed optimizer
    under data parallel 2 (3 layers: a rank's range splits a layer's weight) and tensor x data
    parallel 2, and a mixture of experts under expert parallelism 2 (a chain of two optimizers,
    prefixed), and NeMo 1.x's checkpoint dict (the optimizer under `optimizer_states`, a list, the
    model's keys under `model.`) of the first and the tensor x data parallel one: validate passes
    (no checksums: zarr keeps none), and the fp32 conversion is bit for bit what Megatron's
    optimizer held, in Megatron-Core's standard groups."""
    from torch.distributed.checkpoint import FileSystemReader
    ck = MEGATRON_09 / run
    assert json.loads((ck / "metadata.json").read_text())["sharded_backend"] == "zarr"
    assert not (ck / ".metadata").exists()
    bf16 = run != "zarr_fp32_dp2"
    nemo = run.startswith("nemo1")
    qkv = json.loads((ck / f"{'model.' if nemo else ''}decoder.layers.self_attention.linear_qkv.weight" / ".zarray").read_text())
    assert (qkv["dtype"] == "bfloat16") == bf16
    assert any(p.name.endswith(".sync") for p in ck.iterdir()) == ("distopt" in run or "moe" in run)
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta,
                         checksums="the zarr arrays' chunks carry no checksums; every torch.save record's CRC-32 verified")
    assert info["format"] == "dcp"
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0] + ([0.1] if "moe" in run else [])
    assert any(n.startswith("the model's bf16 weights, the optimizer's fp32 main params") for n in info["not_read"]) == bf16
    assert not any(".sync" in n for n in info["not_read"]), info["not_read"]
    assert any(n.startswith("Megatron-Core's zarr backend") for n in info["read_notes"]), info["read_notes"]
    trainer = [n for n in info["not_read"] if n.startswith("common.pt: ")]
    assert trainer == [f"common.pt: epoch, global_step, pytorch-lightning_version, state_dict, loops, callbacks, "
                       f"lr_schedulers, hparams_name, hyper_parameters (NeMo's Lightning checkpoint)"] if nemo else \
        trainer[0].endswith("(Megatron's trainer state)"), trainer
    assert all(name.startswith("model.") for name in info["params"]) == nemo
    out = tmp_path / "plain_dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0
    assert FileSystemReader(str(out)).read_metadata() is not None  # torch alone reads optstate's


def test_a_damaged_megatron_zarr_checkpoint_is_refused_naming_the_chunk(tmp_path, optstate_cli):
    """A zarr array's chunk file missing (zarr would read fill_value, which Megatron leaves
    undefined) or cut short, a compressed array, common.pt gone, or metadata.json naming another
    backend: each refused naming the file and the array, nothing read from it."""
    def fresh():
        ck = tmp_path / "ck"
        if ck.exists():
            shutil.rmtree(ck)
        shutil.copytree(MEGATRON_09 / "zarr_tp2", ck)
        return ck
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    ck = fresh()
    (ck / key / "1.1.0").unlink()
    err = run_err(optstate_cli, "inspect", ck)
    assert f"{ck}/{key}/1.1.0: chunk [1, 1, 0] of zarr array '{key}': missing" in err, err
    ck = fresh()
    data = (ck / key / "0.1.0").read_bytes()
    (ck / key / "0.1.0").write_bytes(data[:-4])
    err = run_err(optstate_cli, "inspect", ck)
    assert f"{key}/0.1.0: chunk [0, 1, 0] of zarr array '{key}': holds {len(data) - 4} bytes; an uncompressed chunk" in err, err
    validated = optstate_cli("validate", ck, check=False)
    assert validated.returncode == 1 and "FINDING" in validated.stdout and "holds 508 bytes" in validated.stdout
    ck = fresh()
    za = ck / key / ".zarray"
    za.write_text(za.read_text().replace('"compressor": null', '"compressor": {"id": "zstd", "level": 1}'))
    err = run_err(optstate_cli, "inspect", ck)
    assert "chunks compressed with" in err and "zstd" in err and str(za) in err, err
    ck = fresh()
    (ck / "common.pt").unlink()
    err = run_err(optstate_cli, "inspect", ck)
    assert "a Megatron checkpoint" in err and "without its common.pt" in err, err
    ck = fresh()
    (ck / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    err = run_err(optstate_cli, "inspect", ck)
    assert "not a checkpoint in any known format" in err, err


@pytest.mark.parametrize("run", ["dp2_distopt", "dp2_distopt_pre_mcore_014"])
def test_megatron_core_0_15s_checkpoints_read_though_their_metadata_is_megatrons_own_class(tmp_path, optstate_cli, run):
    """Megatron-Core 0.15's planner saves `.metadata` as its own MCoreMetadata (torch's Metadata
    with `mcore_data`), every checkpoint of it: the distributed optimizer saved fully_reshardable,
    and fully_sharded_model_space as Megatron-LM's --dist-ckpt-save-pre-mcore-014 saves it. Both
    read bit for bit as Megatron held them (torch alone cannot unpickle that .metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    ck = MEGATRON_015 / run
    assert b"MCoreMetadata" in (ck / ".metadata").read_bytes()[:200]
    with pytest.raises(ModuleNotFoundError, match="megatron"):
        FileSystemReader(str(ck)).read_metadata()
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0]


@pytest.mark.parametrize("run", ["tp2", "dp2_distopt", "dp2_distopt_dp_reshardable", "moe_ep2", "dp2_distopt_dp_zero"])
def test_megatron_core_0_19s_checkpoints_keep_their_common_state_inside_the_dcp(tmp_path, optstate_cli, run):
    """From Megatron-Core 0.19 (`deprecate common strategy`) torch_dist writes no common.pt: the
    same dict (the optimizer's param groups and step, the trainer's args) is a ShardedObject item of
    the DCP, `common_state/shard_0_1`, torch.save([dict]). Read from there, each form of
    Megatron's optimizers (mixed precision under tensor parallel 2, the distributed optimizer saved
    fully_reshardable, dp_reshardable and dp_zero_gather_scatter, the mixture of experts' chain
    with its items unprefixed as content_metadata says) is bit for bit what Megatron held, the
    item not named as unread, the trainer's keys named as the common state's."""
    ck = MEGATRON_019 / run
    assert not (ck / "common.pt").exists()
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0] + ([0.1] if run.startswith("moe") else [])
    assert any(n.startswith("common state: args, checkpoint_version, iteration, opt_param_scheduler")
               for n in info["not_read"]), info["not_read"]
    assert not any("common_state" in n for n in info["not_read"]), info["not_read"]
    assert any("saved its items unprefixed" in n for n in info["read_notes"]) == (run == "moe_ep2")
    out = tmp_path / "plain_dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0


@pytest.mark.parametrize("run", ["fsdp_dtensor_dp2", "fsdp_dtensor_dp2_bf16"])
def test_a_megatron_fsdp_fsdp_dtensor_checkpoint_reads_as_megatron_held_it(tmp_path, optstate_cli, run):
    """Megatron-LM's --use-megatron-fsdp --ckpt-format fsdp_dtensor saves with torch's DCP alone
    (no metadata.json, no common.pt): the weights and moments are Megatron-FSDP's DTensors, each
    rank's uneven share of each param (a bucket split mid-param: 16 + 8 rows), and the optimizer's
    groups are per param, `optimizer.param_to_group_meta.<name>.<field>`, not param_groups. Made by
    Megatron-Core 0.19's own Megatron-FSDP and distributed optimizer (make_megatron_fsdp.py): the
    fp32 conversion is bit for bit what was handed to DCP, weights included, steps and groups its
    own; the params are named without the wrappers' `module.` (the optimizer's names carry two, or
    three under bf16's Float16Module, the weights' one), which the read note says; the trainer's
    items are named as not read; a DCP write is a plain one that diffs equal."""
    ck = MEGATRON_019 / run / "iter_0000003"
    assert (ck / ".metadata").exists() and not (ck / "metadata.json").exists()
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert sorted(g["weight_decay"] for g in info["param_groups"]) == [0.0, 0.1]
    assert all(not name.startswith("module.") for name in info["params"]), list(info["params"])[:3]
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in info["params"]
    levels = 3 if run.endswith("bf16") else 2
    assert info["read_notes"] == [
        "Megatron-FSDP's checkpoint (Megatron-LM --ckpt-format fsdp_dtensor): each param's group from "
        f"'optimizer.param_to_group_meta'; params named without the wrappers' 'module.' ({levels} of the "
        "optimizer's, 1 of the model's)"], info["read_notes"]
    assert info["not_read"] == ["args (1 item)", "checkpoint_version (1 item)", "iteration (1 item)",
                                "opt_param_scheduler (10 items)", "rng_state (3 items)"], info["not_read"]
    assert info["ranks"] == 2
    out = tmp_path / "plain_dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0
    # the save folder reads as the iteration its tracker names, as Megatron's load_checkpoint does
    save = json.loads(optstate_cli("inspect", MEGATRON_019 / run, "--json").stdout)
    assert save["read_notes"] == ["Megatron-LM's save folder: latest_checkpointed_iteration.txt names "
                                  "iter_0000003/, the iteration read"] + info["read_notes"], save["read_notes"]
    assert hashes_root(optstate_cli, MEGATRON_019 / run) == hashes_root(optstate_cli, ck)


def test_a_megatron_save_folder_opens_the_iteration_its_tracker_names(tmp_path, optstate_cli):
    """A Megatron-LM save folder (--save) holds iter_<N>/ per save and latest_checkpointed_iteration.txt,
    which names the newest complete one (rank 0 writes it once every rank has saved): optstate reads
    that folder (N zero-padded to 7 digits, or 'release'), says so, and never writes over the save
    folder. A tracker that names no DCP folder there, or is no iteration, is not followed: the error
    names the iteration folders the save folder holds."""
    src = MEGATRON_019 / "fsdp_dtensor_dp2"
    save = tmp_path / "checkpoints"
    shutil.copytree(src, save)
    shutil.copytree(src / "iter_0000003", save / "iter_0000001")
    (save / "iter_0000001" / ".metadata").unlink()  # an earlier save that is no DCP: never looked at
    root = hashes_root(optstate_cli, src / "iter_0000003")
    for tracker in ["3", "3\n", " 0000003 \n"]:
        (save / "latest_checkpointed_iteration.txt").write_text(tracker)
        assert hashes_root(optstate_cli, save) == root, tracker
    # validate follows it too (integrity checks and all)
    assert optstate_cli("validate", save).returncode == 0
    # release/ (Megatron's --ckpt-format conversions save there)
    (save / "iter_0000003").rename(save / "release")
    (save / "latest_checkpointed_iteration.txt").write_text("release")
    info = json.loads(optstate_cli("inspect", save, "--json").stdout)
    assert info["read_notes"][0] == ("Megatron-LM's save folder: latest_checkpointed_iteration.txt names release/, "
                                     "the iteration read"), info["read_notes"]
    assert hashes_root(optstate_cli, save) == root
    # never replaced: a convert onto it is refused and leaves it whole
    err = run_err(optstate_cli, "convert", src / "iter_0000003", save, "--format", "dcp", "--overwrite")
    assert "a write never replaces" in err, err
    assert (save / "release" / ".metadata").exists() and hashes_root(optstate_cli, save) == root
    # a tracker naming a folder that is gone, one that is no DCP, or text that is no iteration
    for tracker in ["7", "1", "iter_0000003", "../release", "-3", ""]:
        (save / "latest_checkpointed_iteration.txt").write_text(tracker)
        err = run_err(optstate_cli, "inspect", save)
        assert "not a checkpoint in any known format" in err and "it holds release/ (dcp): pass that directory" in err, (
            tracker, err)


def test_per_param_groups_whose_names_disagree_with_the_state_are_refused_by_name(tmp_path, optstate_cli):
    """param_to_group_meta (Megatron-FSDP's groups) read as torch's flattened groups: a param whose
    state is outside the 'module.' every group name shares has no group and is named; names with
    no wrapper read as they are; a step kept in the group (TransformerEngine's FusedAdam) is each
    param's, and bias_correction=False is refused."""
    import torch.distributed.checkpoint as dcp

    group = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "maximize": False, "wd_mult": 1.0}
    moments = {"exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4), "step": torch.tensor(2.0)}
    plain = tmp_path / "plain"
    dcp.save({"model": {"w": torch.zeros(4)}, "optimizer": {"state": {"w": dict(moments)},
                                                            "param_to_group_meta": {"w": dict(group)}}},
             checkpoint_id=str(plain), no_dist=True)
    info = json.loads(optstate_cli("inspect", plain, "--json", "--no-stats").stdout)
    assert list(info["params"]) == ["w"] and info["params"]["w"]["step"] == 2, info["params"]
    assert "(0 of the optimizer's, 0 of the model's)" in info["read_notes"][0], info["read_notes"]
    odd = tmp_path / "odd"
    dcp.save({"optimizer": {"state": {"module.w": dict(moments), "x": dict(moments)},
                            "param_to_group_meta": {"module.w": dict(group), "module.x": dict(group)}}},
             checkpoint_id=str(odd), no_dist=True)
    r = optstate_cli("inspect", odd, check=False)
    assert r.returncode == 2 and "param 'x' has state but no param_to_group_meta items" in r.stderr, r.stderr
    # TransformerEngine's FusedAdam (Megatron's on GPUs) keeps the step in the group: each param's
    # step is its group's, not an extra group key; bias_correction=False is not AdamW's update
    for name, extra, want in (("te", {}, None), ("no_bias_correction", {"bias_correction": False},
                                                 "bias_correction=False: not AdamW's update")):
        ck = tmp_path / name
        te_group = {**group, "bias_correction": True, "step": 3, **extra}
        dcp.save({"model": {"w": torch.zeros(4), "v": torch.zeros(2)},  # v: never stepped, no state
                  "optimizer": {"state": {"w": {"exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}},
                                "param_to_group_meta": {"w": te_group, "v": te_group}}},
                 checkpoint_id=str(ck), no_dist=True)
        r = optstate_cli("inspect", ck, "--json", "--no-stats", check=False)
        if want:
            assert r.returncode == 2 and want in r.stderr, r.stderr
            continue
        info = json.loads(r.stdout)
        assert info["params"]["w"]["step"] == 3 and "step" not in info["param_groups"][0], info
        assert info["params"]["v"]["step"] == 0, info["params"]


def test_megatron_core_0_19s_integrity_manifest_is_checked_by_validate(tmp_path, optstate_cli):
    """Megatron-LM's --verify-integrity (Megatron-Core 0.19) saves integrity.json beside the DCP:
    each file's SHA-256, as hashlib computes it. validate checks every listed file against it and
    says so; the checkpoint reads as Megatron held it, inspect says the manifest is there, and a
    conversion does not carry it (its digests are of these files). What the CRC-32s leave out is
    caught (metadata.json changed), as are a file the checkpoint reads but the manifest leaves out,
    a listed file that is gone, a listed name that is a path, a digest that is not one, and another
    algorithm: findings naming the file, exit 1."""
    import hashlib
    ck = MEGATRON_019 / "dp2_distopt_integrity"
    manifest = json.loads((ck / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256"
    for name, digest in manifest["files"].items():  # the corpus is what Megatron wrote
        assert hashlib.sha256((ck / name).read_bytes()).hexdigest() == digest, name
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert any(n.startswith("integrity.json (Megatron-LM's --verify-integrity)") for n in info["read_notes"])
    report = json.loads(optstate_cli("validate", ck, "--json").stdout)
    assert report["ok"] and report["file_digests"] == "integrity.json: the SHA-256 of all 4 files verified", report
    assert "; integrity.json: the SHA-256 of all 4 files verified" in optstate_cli("validate", ck).stdout
    assert json.loads(optstate_cli("validate", MEGATRON_019 / "tp2", "--json").stdout)["file_digests"] is None
    out = tmp_path / "plain_dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert not (out / "integrity.json").exists()

    def edit_manifest(edit):
        return lambda case: (case / "integrity.json").write_text(json.dumps(edit(json.loads(
            (case / "integrity.json").read_text()))))
    cases = {
        "changed": (lambda case: (case / "metadata.json").write_text(
                        (case / "metadata.json").read_text().replace(", ", ",  ")),
                    "metadata.json: its SHA-256 differs from the one in integrity.json (stored 56b32e2dfbc0255d"),
        "unlisted": (edit_manifest(lambda m: {**m, "files": {k: v for k, v in m["files"].items()
                                                             if k != "__1_0.distcp"}}),
                     "__1_0.distcp is read but not listed in integrity.json"),
        "gone": (edit_manifest(lambda m: {**m, "files": {**m["files"], "extra.pt": "0" * 64}}),
                 "extra.pt: listed in integrity.json but missing"),
        "path": (edit_manifest(lambda m: {**m, "files": {**m["files"], "../x": "0" * 64}}),
                 "'../x' is not a file name of the checkpoint folder"),
        "digest": (edit_manifest(lambda m: {**m, "files": {**m["files"], ".metadata": "not hex"}}),
                   "file '.metadata': its digest is not 64 lowercase hex digits"),
        "md5": (edit_manifest(lambda m: {**m, "algorithm": "md5"}), "digests by 'md5', not sha256"),
    }
    for name, (damage, want) in cases.items():
        case = tmp_path / name
        shutil.copytree(ck, case)
        damage(case)
        proc = optstate_cli("validate", case, check=False)
        assert proc.returncode == 1 and want in proc.stdout and str(case) in proc.stdout, (name, proc.stdout,
                                                                                          proc.stderr)


def test_a_folder_that_holds_a_checkpoint_a_few_levels_down_names_it(tmp_path, optstate_cli):
    """A folder that is no checkpoint but holds one up to three levels down is refused with the
    path to pass, the shallowest found, e.g. NeMo RL's step_N/ of its Megatron backend (Megatron's
    save folder policy/weights/ with iter_0000000/ in it), or a run folder of NeMo RL step folders;
    deeper than that, or where nothing opens, no path is named; a symlink back up is not followed
    round."""
    step = tmp_path / "results" / "step_5"
    shutil.copytree(MEGATRON_019 / "tp2", step / "policy" / "weights" / "iter_0000000")
    (step / "training_info.json").write_text("{}")
    (step / "policy" / "weights" / "up").symlink_to(tmp_path, target_is_directory=True)
    err = run_err(optstate_cli, "inspect", step)
    assert err.rstrip().endswith("; it holds policy/weights/iter_0000000/ (dcp): pass that directory"), err
    runs = tmp_path / "runs"
    for n in (2, 4):
        shutil.copytree(NEMO_RL / "dtensor_v2" / "step_2", runs / f"step_{n}")
    err = run_err(optstate_cli, "inspect", runs)
    assert "it holds step_2/ (dcp), step_4/ (dcp): pass one of them" in err, err
    err = run_err(optstate_cli, "inspect", tmp_path / "results")  # four levels down
    assert "it holds" not in err and "not a checkpoint in any known format" in err, err


def test_a_folder_of_many_step_folders_names_the_newest_without_opening_them_all(tmp_path, optstate_cli):
    """torchtitan's checkpoint/ holds step-<N>/ per save and no tracker: pointed at it, a command
    names the last eight in numeric order (step-10 after step-9) that open, and counts those before
    them that look like checkpoints, unopened (opening a hundred large DCPs for an error message
    would take long). A newest save that does not open is left out of the list."""
    runs = tmp_path / "checkpoint"
    for n in range(1, 13):
        shutil.copytree(MEGATRON_019 / "dp2_distopt", runs / f"step-{n}")
    (runs / "step-12" / ".metadata").write_bytes(b"\x80\x04")  # cut short: sniffs, does not open
    err = run_err(optstate_cli, "inspect", runs)
    listed = ", ".join(f"step-{n}/ (dcp)" for n in range(4, 12))
    assert err.rstrip().endswith(f"; it holds {listed} (and 3 more before them that look like checkpoints): "
                                 "pass one of them"), err


REWRITE_MEGATRON_COMMON = textwrap.dedent("""
    # Writes Megatron checkpoint SRC again as one process's DCP at DST (metadata.json copied), its
    # tensors as they were, its common_state item per CASE (its value torch.save'd, as Megatron does).
    import shutil, sys, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    src, dst, case = sys.argv[1:4]
    dcp_to_torch_save(src, dst + ".pt")
    sd = torch.load(dst + ".pt", weights_only=False)
    key = "common_state/shard_0_1"
    common = sd[key][0]
    if case == "missing":
        del sd[key]
    elif case == "two":
        sd[key] = [common, common]
    elif case == "no_optimizer":
        sd[key] = [{k: v for k, v in common.items() if k != "optimizer"}]
    # not flattened: each object item stored whole as its torch.save bytes, as Megatron stores them
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False)
    dcp.save(sd, checkpoint_id=dst, no_dist=True, planner=planner)
    shutil.copy(src + "/metadata.json", dst)
""")


def test_a_megatron_core_0_19_checkpoint_whose_common_state_is_missing_or_wrong_is_refused_naming_it(tmp_path,
                                                                                                   optstate_cli):
    """The same checkpoint written again by torch's DCP reads the same values (the harness changes
    nothing else of them); without its common_state item, with a list of two dicts in it, or with a dict
    that has no optimizer, it is refused by name (the item, what is wrong), and nothing is written."""
    src = MEGATRON_019 / "tp2"
    want = {
        "same": None,
        "missing": "without its common state (no common.pt, nor Megatron-Core 0.19's 'common_state/shard_0_1' item)",
        "two": "item 'common_state/shard_0_1': not [the common state dict]",
        "no_optimizer": "item 'common_state/shard_0_1': a Megatron checkpoint without optimizer state "
                        "(item 'common_state/shard_0_1' has no 'optimizer'",
    }
    for case, message in want.items():
        dst = tmp_path / case
        run_script(tmp_path, REWRITE_MEGATRON_COMMON, "rewrite.py", src, dst, case)
        if message is None:  # every tensor the same (the groups not: each item is now one whole chunk, and
            # Megatron's stacked layer axes, which its standard groups leave out, are told from per-layer chunks)
            for ck in (src, dst):
                optstate_cli("convert", ck, tmp_path / f"{ck.name}.safetensors", "--to", "fp32")
            a, b = st_load(tmp_path / "tp2.safetensors"), st_load(tmp_path / "same.safetensors")
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            continue
        err = run_err(optstate_cli, "convert", dst, tmp_path / f"{case}.safetensors")
        assert message in err and str(dst) in err, (case, err)
        assert not (tmp_path / f"{case}.safetensors").exists()


@pytest.mark.parametrize("run", ["dp2_distopt_dp_reshardable", "tp2_dp2_distopt_dp_reshardable",
                                 "moe_ep2_dp_reshardable", "pp2_dp2_distopt_dp_reshardable",
                                 "pp2_vp2_dp2_distopt_dp_reshardable"])
def test_megatrons_default_dp_reshardable_checkpoint_reads_as_megatron_held_it(tmp_path, optstate_cli, run):
    """The distributed optimizer's default form since Megatron-Core 0.14, dp_reshardable: each
    model-parallel rank's DDP buckets as flat items (main params, moments), each param's part on
    each data-parallel rank a chunk of its own, which param lies where not saved. Placed by value
    on the model's weights beside (the main params round to them): data parallel 2 over 3 layers
    (a param split between the ranks' halves of a bucket), tensor parallel 2 x data parallel 2
    (column- and row-parallel parts in each rank's buckets, layer norms replicated in both), the
    mixture of experts (a chain of two distributed optimizers, prefixed), and pipeline parallel 2
    (each stage's data-parallel group's buckets; the last stage's copy of the tied embedding in
    its buckets, a replica of the first stage's), also under a virtual pipeline (two model chunks
    a stage through the interleaved schedule, each chunk's buffers its own): bit for bit what
    Megatron's optimizer held (each rank's main params and moments over its range of each param,
    read from the live optimizer), in Megatron-Core's
    standard groups, said as placed by value."""
    ck = MEGATRON / run
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0] + ([0.1] if run.startswith("moe") else [])
    assert any("saved dp_reshardable" in n and "round to the model's weights" in n for n in info["read_notes"])
    assert not any("optimizer.distributed" in n for n in info["not_read"]), info["not_read"]
    assert any(n.startswith("the model's bf16 weights, the optimizer's fp32 main params") for n in info["not_read"])
    out = tmp_path / "plain_dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0


@pytest.mark.parametrize("corpus,run", [(MEGATRON, "dp2_distopt_dp_zero"), (MEGATRON, "tp2_dp2_distopt_dp_zero"),
                                        (MEGATRON_09, "zarr_dp2_distopt_dp_zero"),
                                        (MEGATRON_09, "zarr_tp2_dp2_distopt_dp_zero")])
def test_megatrons_dp_zero_gather_scatter_checkpoint_reads_as_megatron_held_it(tmp_path, optstate_cli, corpus, run):
    """The distributed optimizer saved dp_zero_gather_scatter (Megatron-LM's without
    --ckpt-fully-parallel-save up to 0.13, NeMo 1.x's without dist_ckpt_parallel_save; still saved
    by 0.16): each data-parallel group's DDP buffers gathered on its rank 0 into one ShardedObject,
    flat main params and moments, its buckets one after another, whose layout is not saved.
    Each param's bounds walked by value (where the last param ended or at its 64-aligned start, the
    weights beside rounding from the main params there), then placed as dp_reshardable's:
    Megatron-Core 0.16's torch_dist under data parallel 2 (3 layers: a param split between the
    ranks' halves of the buffer) and tensor x data parallel 2 with several buckets, and 0.9's
    zarr under data parallel 2 and tensor x data parallel 2 (several buckets): bit for bit what
    Megatron's optimizer held (read from the live optimizer), in Megatron-Core's standard groups,
    said as placed by value. The gathered state is read in runs, parts of its storages' records:
    validate checks each record whole against the CRC-32 torch.save stored (the zarr arrays beside,
    which keep none, only place the params: every byte of the state is covered)."""
    ck = corpus / run
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta, checksums=True)
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0]
    assert any("saved dp_zero_gather_scatter" in n and "round to the model's weights" in n for n in info["read_notes"])
    assert not any("optimizer.distributed" in n for n in info["not_read"]), info["not_read"]
    out = tmp_path / "plain_dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0


def test_a_flipped_bit_in_dp_zero_gather_scatters_gathered_buffers_is_a_validate_finding(tmp_path, optstate_cli):
    """One bit of a gathered moment flipped (a finite value, still in place): reading cannot tell,
    but torch.save stored the CRC-32 of the record it lies in, which validate reads whole: a
    finding naming the item, the entry and its storage (exit 1)."""
    from torch.distributed.checkpoint import FileSystemReader
    ck = tmp_path / "ck"
    shutil.copytree(MEGATRON / "dp2_distopt_dp_zero", ck)
    md = FileSystemReader(str(ck)).read_metadata()
    loc = next(v for k, v in md.storage_data.items() if k.fqn.endswith("param_state/shard_0_1"))
    data = bytearray((ck / loc.relative_path).read_bytes())
    data[loc.offset + loc.length // 2] ^= 0x01
    (ck / loc.relative_path).write_bytes(bytes(data))
    assert optstate_cli("hash", ck).returncode == 0  # read in runs: nothing to check a run against
    proc = optstate_cli("validate", ck, check=False)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert ("item 'optimizer.distributed.dp_group_idx_0.param_state/shard_0_1' [0] '" in proc.stdout
            and "fails the CRC-32 torch.save stored" in proc.stdout), proc.stdout


def test_a_dp_zero_gather_scatter_checkpoint_whose_weights_are_stale_is_refused(tmp_path, optstate_cli):
    """A param's weights beside that are not what its main params round to (here a chunk of the
    final layer norm's overwritten with other values): the walk finds no weight at that place of
    the gathered buffer, refused naming the element, not read misplaced; without the gathered
    state, or without the model's weights at all, refused saying what is missing."""
    ck = tmp_path / "ck"
    shutil.copytree(MEGATRON_09 / "zarr_dp2_distopt_dp_zero", ck)
    chunk = ck / "decoder.final_layernorm.weight" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[0:2] = bytes([0x80, 0x3f])  # bf16 1.0 where the weight is not quite one
    raw[2:4] = bytes([0x00, 0x40])  # 2.0
    chunk.write_bytes(bytes(raw))
    err = run_err(optstate_cli, "inspect", ck)
    assert "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1' [0]: no model weight's values lie at element" in err, err
    missing = tmp_path / "missing"
    shutil.copytree(MEGATRON_09 / "zarr_dp2_distopt_dp_zero", missing)
    shutil.rmtree(missing / "optimizer.distributed.dp_group_idx_0.param_state")
    err = run_err(optstate_cli, "inspect", missing)
    assert "saved dp_zero_gather_scatter without its state's items (no optimizer.distributed" in err, err
    for p in list(ck.iterdir()):
        if p.is_dir() and not p.name.startswith("optimizer.") and p.name != "rng_state":
            shutil.rmtree(p)
    err = run_err(optstate_cli, "inspect", ck)
    assert "no model weights beside to place its params by" in err, err


def test_a_dp_zero_gather_scatter_state_of_another_form_is_refused_naming_it(tmp_path, optstate_cli):
    """The gathered state as older or other Megatron-Cores saved it, or damaged: buckets saved apart
    (before 0.7: not buckets_coalesced), a buffer's params of another dtype, a flat tensor shorter
    than numel_unpadded, an entry missing: each refused naming the object and the buffer."""
    src = MEGATRON_09 / "zarr_dp2_distopt_dp_zero"
    shard = "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1.pt"
    state = torch.load(src / shard, weights_only=False)
    (dtypes, buf), = state[0].items()

    def refused(edit, expect):
        ck = tmp_path / "ck"
        if ck.exists():
            shutil.rmtree(ck)
        shutil.copytree(src, ck)
        d = {"buckets_coalesced": True, 0: {dtypes: dict(buf)}}
        edit(d)
        torch.save(d, ck / shard)
        err = run_err(optstate_cli, "inspect", ck)
        assert shard.removesuffix(".pt") in err and expect in err, err

    refused(lambda d: d.update(buckets_coalesced=False), "not 'buckets_coalesced'")
    refused(lambda d: d.update({0: {(torch.float64, torch.float32): dict(buf)}}), "[0]: params of torch.float64")
    refused(lambda d: d[0][dtypes].update(exp_avg=buf["exp_avg"][:-1].clone()),
            f"[0] 'exp_avg': not a float32 tensor of its numel_unpadded {buf['numel_unpadded']} elements")
    refused(lambda d: d[0][dtypes].pop("exp_avg_sq"), "[0] 'exp_avg_sq': missing")
    refused(lambda d: d[0].update({(torch.bfloat16, torch.bfloat16): dict(buf)}), "not one dtype's state")


def test_a_dp_reshardable_checkpoint_whose_weights_do_not_match_its_buckets_is_refused(tmp_path, optstate_cli):
    """dp_reshardable's params are placed by the model's weights: a weight changed after the step
    (here one element of the final layer norm's, in its storage) leaves its state in the buckets
    matched by none, which is refused (exit 2) naming the bucket's elements, not read misplaced."""
    import io
    from torch.distributed.checkpoint import FileSystemReader
    ck = tmp_path / "ck"
    shutil.copytree(MEGATRON / "dp2_distopt_dp_reshardable", ck)
    md = FileSystemReader(str(ck)).read_metadata()
    (index, info), = [(i, v) for i, v in md.storage_data.items() if i.fqn == "decoder.final_layernorm.weight"]
    path = ck / info.relative_path
    raw = bytearray(path.read_bytes())
    region = bytes(raw[info.offset:info.offset + info.length])
    weight = torch.load(io.BytesIO(region), weights_only=True)
    at = region.index(weight.contiguous().view(torch.uint8).numpy().tobytes())
    raw[info.offset + at + 1] ^= 0x40  # the first element's high byte
    path.write_bytes(bytes(raw))
    err = run_err(optstate_cli, "inspect", ck)
    assert "hold the state of a param none of the model's weights in the checkpoint matches" in err, err
    assert "of optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0" in err, err


def test_megatrons_fully_reshardable_save_with_several_buckets_misplaced_its_state_and_is_refused(optstate_cli):
    """Megatron-Core 0.15 and 0.16 (every release with the form, up to 0.16.1) saved the distributed
    optimizer fully_reshardable with its params' state misplaced wherever its DDP buffer had several buckets (its gather strips the padding
    between buckets, then slices each param at its padded offset): `optimizer.state.*.<key>` hold
    another param's values, and Megatron's own load takes them as they are. The fp32 main params
    are then far from the model's weights saved beside (which Megatron copies from them, rounded or
    fp8-quantized): refused (exit 2) naming the param and the cause, not converted into state that
    looks valid."""
    err = run_err(optstate_cli, "inspect", MEGATRON / "dp2_distopt_buckets_misplaced")
    assert "its fp32 main params are not the model's bf16 weights saved beside" in err, err
    assert "Megatron-Core 0.15 and 0.16 saved fully_reshardable with several DDP buckets" in err, err


def rewrite_weight(ck, key, change):
    """The model weight `key` of the Megatron checkpoint `ck` changed in its storage, `change` given
    and returning its values (same dtype and shape)."""
    import io
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(ck)).read_metadata()
    for index, info in md.storage_data.items():
        if index.fqn != key:
            continue
        path = ck / info.relative_path
        raw = bytearray(path.read_bytes())
        region = bytes(raw[info.offset:info.offset + info.length])
        weight = torch.load(io.BytesIO(region), weights_only=True)
        old = weight.contiguous().view(torch.uint8).numpy().tobytes()
        new = change(weight).contiguous().view(torch.uint8).numpy().tobytes()
        at = info.offset + region.index(old)
        raw[at:at + len(new)] = new
        path.write_bytes(bytes(raw))


def test_megatron_main_params_are_checked_against_the_weights_beside_within_fp8_rounding(tmp_path, optstate_cli):
    """The weights Megatron saves beside fp32 main params are those main params rounded to bf16,
    or with --fp8-param-gather quantized to fp8 (e4m3: within 1/16): weights off by 1/32 still read;
    weights unrelated to the main params (another param's) are refused, naming the param."""
    ck = tmp_path / "ck"
    shutil.copytree(MEGATRON / "dp2_distopt", ck)
    key = "decoder.layers.mlp.linear_fc1.weight"
    rewrite_weight(ck, key, lambda w: (w.float() * (1 + 1 / 32)).to(w.dtype))
    assert optstate_cli("inspect", ck, "--no-stats").returncode == 0
    rewrite_weight(ck, key, lambda w: torch.randn(w.shape, generator=torch.Generator().manual_seed(0)).to(w.dtype))
    err = run_err(optstate_cli, "inspect", ck)
    assert f"param '{key}': its fp32 main params are not the model's bf16 weights saved beside" in err, err


def test_a_dp_reshardable_checkpoint_without_the_models_weights_is_refused_naming_the_flag(tmp_path, optstate_cli):
    """Without the model's weights beside (verl's Megatron backend saves its optimizer's dist_ckpt/
    apart from the model's), nothing places dp_reshardable's flat buckets: refused, naming the flag
    that saves the per-param form."""
    import pickle
    from torch.distributed.checkpoint import FileSystemReader
    ck = tmp_path / "ck"
    shutil.copytree(MEGATRON / "dp2_distopt_dp_reshardable", ck)
    md = FileSystemReader(str(ck)).read_metadata()
    model = {k for k in md.state_dict_metadata if not k.startswith(("optimizer.", "rng_state"))}
    assert "decoder.layers.mlp.linear_fc1.weight" in model
    for k in model:
        del md.state_dict_metadata[k]
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn not in model}
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)
    err = run_err(optstate_cli, "inspect", ck)
    assert "no model weights beside" in err and "--dist-ckpt-optim-fully-reshardable" in err, err


def test_a_damaged_tensor_parallel_shard_of_a_megatron_checkpoint_fails_its_crc(tmp_path, optstate_cli):
    """A row-parallel layer's chunk (its columns split over the two tensor-parallel ranks) is read
    in pieces, row by row: a byte changed in the last of its rows is still caught by the chunk's
    CRC-32 (validate names the item), not passed over as an unchecked part."""
    import shutil
    from torch.distributed.checkpoint import FileSystemReader
    ck = tmp_path / "tp2"
    shutil.copytree(MEGATRON / "tp2", ck)
    key = "optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_proj.weight"
    md = FileSystemReader(str(ck)).read_metadata()
    chunks = md.state_dict_metadata[key].chunks
    assert any(c.sizes[2] < md.state_dict_metadata[key].size[2] for c in chunks)  # columns split
    index = next(i for i in md.storage_data if i.fqn == key and i.offset[2] > 0)
    info = md.storage_data[index]
    path = ck / info.relative_path
    data = bytearray(path.read_bytes())
    # the item is a torch.save archive: its storage record lies before the central directory;
    # the last float of the record's data is 4 bytes before the first zip record after it
    blob = bytes(data[info.offset:info.offset + info.length])
    import io
    import zipfile
    z = zipfile.ZipFile(io.BytesIO(blob))
    rec = next(e for e in z.infolist() if "/data/" in e.filename)
    start = rec.header_offset + 30 + len(rec.filename) + len(rec.extra)
    at = info.offset + start + rec.file_size - 2
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    proc = optstate_cli("validate", ck, check=False)
    assert proc.returncode != 0, proc.stdout
    out = proc.stdout + proc.stderr
    assert f"item '{key}'" in out and "fails the CRC-32 torch.save stored" in out, out


def test_verls_megatron_model_folder_points_at_its_optimizer_folder(tmp_path, optstate_cli):
    """verl's Megatron backend saves global_step_N/actor/{model,optimizer,extra}/dist_ckpt/, each a
    torch_dist checkpoint: the model's holds no optimizer, and optstate names the folder that does
    (which reads as Megatron held it)."""
    import shutil
    actor = tmp_path / "global_step_3" / "actor"
    for part in ("model", "optimizer"):
        (actor / part).mkdir(parents=True)
        shutil.copytree(MEGATRON / "tp2", actor / part / "dist_ckpt")
    common = actor / "model" / "dist_ckpt" / "common.pt"
    c = torch.load(common, weights_only=False)
    del c["optimizer"]
    torch.save(c, common)
    err = run_err(optstate_cli, "inspect", actor / "model" / "dist_ckpt")
    assert "model alone" in err and str(actor / "optimizer" / "dist_ckpt") in err, err
    assert optstate_cli("diff", actor / "optimizer" / "dist_ckpt", MEGATRON / "tp2").returncode == 0


def test_verls_save_folder_reads_the_actor_of_the_step_its_tracker_names(tmp_path, optstate_cli):
    """verl's trainer saves global_step_<N>/ per save (actor/, critic/ under PPO, data.pt) into
    trainer.default_local_dir and then writes N to latest_checkpointed_iteration.txt there: that
    folder reads as the tracked step's actor/ (FSDP's per-rank files, or the Megatron backend's
    dist_ckpt/ below it: actor/dist_ckpt/ before verl's v2 layout, actor/optimizer/dist_ckpt/ in it),
    or its critic/ where it has no actor/. A step holding both, a step not there and an actor/
    holding no optimizer are refused by name; what reads is never looked for in other steps."""
    fsdp = CORPUS.parent / "torch_versions" / "torch-2.11.0_torchao-0.16.0" / "fsdp2_world2"
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        shutil.copytree(fsdp, root / f"global_step_{step}" / "actor")
        (root / f"global_step_{step}" / "data.pt").write_bytes(b"")
    torch.save({"n": 1}, root / "global_step_2" / "actor" / "optim_world_size_2_rank_1.pt")  # step 2 is broken
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    want = hashes_root(optstate_cli, fsdp)
    assert hashes_root(optstate_cli, root) == want
    info = json.loads(optstate_cli("inspect", root, "--json").stdout)
    assert info["format"] == "torchsave" and info["ranks"] == 2, info
    assert info["read_notes"][:1] == ["verl's save folder: latest_checkpointed_iteration.txt names global_step_4/, "
                                      "whose actor/ is read"], info["read_notes"]
    assert optstate_cli("validate", root).returncode == 0
    # PPO: the critic beside the actor
    shutil.copytree(fsdp, root / "global_step_4" / "critic")
    err = run_err(optstate_cli, "inspect", root)
    assert ("verl's save folder: the step its latest_checkpointed_iteration.txt names, global_step_4/, holds actor/ "
            "and critic/, each with an optimizer of its own: pass one of them") in err, err
    shutil.rmtree(root / "global_step_4" / "actor")
    assert hashes_root(optstate_cli, root) == want
    # a tracker ahead of the steps there (a step deleted): the error lists what there is
    (root / "latest_checkpointed_iteration.txt").write_text("9\n")
    err = run_err(optstate_cli, "inspect", root)
    assert "latest_checkpointed_iteration.txt names global_step_9/, which is not there" in err, err
    assert "it holds global_step_4/critic/ (torchsave): pass that directory" in err, err
    # the Megatron backend: actor/dist_ckpt/ (a torch_dist checkpoint of the model and optimizer)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    actor = root / "global_step_3" / "actor"
    shutil.copytree(MEGATRON / "tp2", actor / "dist_ckpt")
    want = hashes_root(optstate_cli, MEGATRON / "tp2")
    assert hashes_root(optstate_cli, root) == want
    # ... its v2 layout: {model,optimizer}/dist_ckpt/, the model's without optimizer state
    (actor / "dist_ckpt").rename(actor / "optimizer_dist_ckpt")
    (actor / "optimizer").mkdir()
    (actor / "optimizer_dist_ckpt").rename(actor / "optimizer" / "dist_ckpt")
    shutil.copytree(MEGATRON / "tp2", actor / "model" / "dist_ckpt")
    common = actor / "model" / "dist_ckpt" / "common.pt"
    c = torch.load(common, weights_only=False)
    del c["optimizer"]
    torch.save(c, common)
    assert hashes_root(optstate_cli, root) == want
    info = json.loads(optstate_cli("inspect", root, "--json").stdout)
    assert info["format"] == "dcp" and info["path"].endswith("global_step_3/actor/optimizer/dist_ckpt"), info["path"]
    assert info["read_notes"][:1] == ["verl's save folder: latest_checkpointed_iteration.txt names global_step_3/, "
                                      "whose actor/ is read (optimizer/dist_ckpt)"], info["read_notes"]
    # an actor/ that holds no optimizer (checkpoint.save_contents without it)
    shutil.rmtree(actor / "optimizer")
    err = run_err(optstate_cli, "inspect", root)
    assert "global_step_3/actor/ holds no checkpoint optstate reads" in err, err
    # never written over
    err = run_err(optstate_cli, "convert", MEGATRON / "tp2", root, "--format", "dcp", "--overwrite")
    assert "is not a checkpoint" in err and (root / "latest_checkpointed_iteration.txt").exists(), err


def test_nemo2s_list_of_one_optimizer_in_common_pt_reads_as_megatrons(tmp_path, optstate_cli):
    """NeMo 2's MegatronStrategy saves the same torch_dist checkpoint with common.pt's optimizer a
    list of Lightning's optimizers (`checkpoint["optimizer"] = [sharded_state_dict]`) beside
    Lightning's trainer state: one reads as Megatron's own; two are refused."""
    import shutil
    ck = tmp_path / "weights"
    shutil.copytree(MEGATRON / "tp2", ck)
    c = torch.load(ck / "common.pt", weights_only=False)
    c = {"state_dict": {}, "optimizer": [c["optimizer"]], "lr_schedulers": [c["opt_param_scheduler"]],
         "epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.5.0", "content_metadata": c["content_metadata"]}
    torch.save(c, ck / "common.pt")
    assert optstate_cli("diff", ck, MEGATRON / "tp2").returncode == 0
    assert "common.pt: state_dict, lr_schedulers, epoch, global_step" in optstate_cli("inspect", ck, "--no-stats").stdout
    c["optimizer"] = c["optimizer"] * 2
    torch.save(c, ck / "common.pt")
    assert "a list of 2 optimizers" in run_err(optstate_cli, "inspect", ck)


@pytest.mark.parametrize("run", ["dp2", "dp2_zero1", "pp2", "tp2", "pp2_dp2_zero1", "tp2_dp2_zero1", "pp2_tied"])
def test_nanotron_checkpoints_read_as_nanotron_held_them(tmp_path, optstate_cli, run):
    """nanotron's LlamaForTraining trained 3 steps and saved by nanotron itself (make_nanotron.py):
    data parallel without ZeRO (one file), ZeRO-1 over 2 ranks (each param split in two runs,
    placed by optimizer_config.json), pipeline parallel 2 (a file per stage, each numbering its own
    params from 0), tensor parallel 2 (each rank's shards, fused q/k/v and gate/up split part by
    part, placed by the model folder's shard metadata), and ZeRO-1 under pipeline parallelism
    (optimizer_config.json holds stage 0's runs only: stage 1's split by nanotron's rule over the
    model folder's shapes) and under tensor parallelism (runs of each shard), and pipeline parallel
    with SmolLM's tied embeddings (one param stepped on both stages: the first stage's copy read,
    said, its second group left out): validate passes with
    every checksum checked, the fp32 conversion is bit for bit what the live optimizers held (the
    fp32 weights of its gradient accumulator as the params), params named as nanotron names them,
    steps and each of nanotron's per-param groups its own. The checkpoint's folder and its
    optimizer/ read alike; a DCP written from it holds the same state."""
    ck = NANOTRON / run
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert info["format"] == "nanotron" and len(info["param_groups"]) == len(meta), info["param_groups"]
    tied = [n for n in info["read_notes"] if "tied across them" in n]
    assert len(tied) == (run == "pp2_tied"), info["read_notes"]
    assert all(g["params"] == 1 for g in info["param_groups"])  # nanotron's group per param
    assert {"checkpoint_metadata.json", "lr_scheduler/"} <= set(info["not_read"]), info["not_read"]
    assert any(n.startswith("model/ (the model's weights") for n in info["not_read"]), info["not_read"]
    assert all(g["extras"]["initial_lr"] == 3e-4 for g in info["param_groups"])  # the schedule's, kept
    assert optstate_cli("diff", ck, ck / "optimizer").returncode == 0
    out = tmp_path / "dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0


def test_one_nanotron_optimizer_file_names_its_params_and_reads_its_fp32_weights(optstate_cli):
    """A stage's file alone (torch.save of NamedOptimizer's state_dict): its params take the names
    of its 'names' dict, not torch's numbers, and its 'gradient_accumulator' is their fp32 weights;
    nothing of it is left unread. A ZeRO-1 rank's or tensor-parallel rank's file alone holds runs or
    shards, not params: refused, naming the checkpoint's folder to read instead."""
    ck = NANOTRON / "dp2"
    one = ck / "optimizer" / "optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt"
    info = json.loads(optstate_cli("inspect", one, "--json", "--no-stats").stdout)
    _, meta = ref_of(ck)
    assert info["format"] == "torchsave" and set(info["params"]) == set(meta), sorted(info["params"])[:3]
    assert all("param" in p["entries"] for p in info["params"].values())
    assert info["not_read"] == [], info["not_read"]
    assert optstate_cli("diff", one, ck).returncode == 0
    # one rank's part alone (ZeRO-1's runs, a tensor-parallel shard) is no param's state: refused
    for run, name in [("dp2_zero1", "optimizer_pp-0-of-1_dp-1-of-2_tp-0-of-1_exp-0-of-1.pt"),
                      ("tp2", "optimizer_pp-0-of-1_tp-1-of-2_exp-0-of-1.pt")]:
        err = run_err(optstate_cli, "inspect", NANOTRON / run / "optimizer" / name)
        assert "one rank's file of a nanotron checkpoint" in err and str(NANOTRON / run) in err, err


def test_an_optimizer_dicts_keys_beside_its_state_are_named_as_not_read(tmp_path, optstate_cli):
    """Keys of the optimizer state_dict other than 'state' and 'param_groups' (a wrapper's own) are
    named, not dropped without a word; a torch.save write does not claim to carry them."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    opt.step()
    sd = opt.state_dict()
    sd["wrapper_counter"] = 7
    torch.save(sd, tmp_path / "opt.pt")
    info = json.loads(optstate_cli("inspect", tmp_path / "opt.pt", "--json", "--no-stats").stdout)
    assert info["not_read"] == ["the optimizer dict's 'wrapper_counter'"], info["not_read"]
    proc = optstate_cli("convert", tmp_path / "opt.pt", tmp_path / "out.pt")
    assert "wrapper_counter" in proc.stdout + proc.stderr


def test_nanotron_checkpoints_optstate_cannot_place_are_refused_by_name(tmp_path, optstate_cli):
    """A missing rank's file, a config whose run of a param disagrees with the rank's tensor of it,
    a file holding a param the config gives its rank no run of, a tensor-parallel checkpoint without
    its model folder, without a param's file in it, or with a shard's metadata that places its
    elements twice are refused naming
    the file and the param (validate: a finding); nothing is written as nanotron's."""
    import shutil
    tp = tmp_path / "tp"
    shutil.copytree(NANOTRON / "tp2" / "optimizer", tp / "optimizer")
    assert "read with its model folder" in run_err(optstate_cli, "inspect", tp)
    shutil.copytree(NANOTRON / "tp2" / "model", tp / "model")
    norm = tp / "model" / "model" / "final_layer_norm" / "pp_block" / "model_weight.safetensors"
    saved_norm = norm.read_bytes()
    norm.unlink()  # then whether a rank's tensor of it is a shard or a copy is unknown
    err = run_err(optstate_cli, "inspect", tp)
    assert "'model.final_layer_norm.pp_block.weight': the model folder has no file of it" in err, err
    norm.write_bytes(saved_norm)
    shard = next((tp / "model").rglob("model_weight_pp-rank-0-of-1_tp-rank-1-of-2.safetensors"))
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    with safe_open(str(shard), "pt") as f:
        md = f.metadata()
    md["local_global_slices_pairs"] = md["local_global_slices_pairs"] + ";" + md["local_global_slices_pairs"]
    save_file(load_file(str(shard)), str(shard), metadata=md)
    err = run_err(optstate_cli, "inspect", tp)
    assert str(shard) in err and "twice" in err, err
    ck = tmp_path / "zero"
    shutil.copytree(NANOTRON / "dp2_zero1", ck)
    rank1 = ck / "optimizer" / "optimizer_pp-0-of-1_dp-1-of-2_tp-0-of-1_exp-0-of-1.pt"
    saved = rank1.read_bytes()
    rank1.unlink()
    assert "pipeline stage 0, data-parallel rank 1, has no optimizer file" in run_err(optstate_cli, "inspect", ck)
    rank1.write_bytes(saved)
    config_path = ck / "optimizer" / "optimizer_config.json"
    config = json.loads(config_path.read_text())
    name = "model.decoder.0.pp_block.attn.o_proj.weight"
    runs = config["configs"]["param_name_to_dp_rank_offsets"][name]
    runs["1"] = [str(int(runs["1"][0]) + 1), runs["1"][1]]
    config_path.write_text(json.dumps(config))
    err = run_err(optstate_cli, "inspect", ck)
    assert f"{rank1} param '{name}'" in err and "[129, 256) of optimizer_config.json has 127 elements" in err, err
    proc = optstate_cli("validate", ck, check=False)
    assert proc.returncode == 1 and name in proc.stdout, proc.stdout
    del config["configs"]["param_name_to_dp_rank_offsets"][name]["1"]
    config_path.write_text(json.dumps(config))
    err = run_err(optstate_cli, "inspect", ck)
    assert str(rank1) in err and name in err and "no run of it" in err, err
    err = run_err(optstate_cli, "convert", NANOTRON / "dp2", tmp_path / "back", "--format", "nanotron")
    assert "not as nanotron's" in err and not (tmp_path / "back").exists(), err


def edit_rank_files(tmp_path, edit, *files):
    """Runs the Python statement `edit` on each torch.save file's loaded dict `d`, saving it back."""
    run_script(tmp_path, textwrap.dedent("""
        import sys, torch
        for f in sys.argv[1:]:
            d = torch.load(f, weights_only=False)
            {}
            torch.save(d, f)
    """).format(edit), "edit.py", *files)


@pytest.mark.parametrize("run", ["legacy_dp2", "legacy_fp32_dp2", "legacy_tp2", "legacy_tp2_swiglu",
                                 "legacy_dp2_distopt", "legacy_tp2_dp2_distopt", "legacy_pp2",
                                 "legacy_tp2_pp2_dp2_distopt", "legacy_pp2_vp2", "legacy_pp2_vp2_dp2_distopt"])
def test_a_megatron_legacy_checkpoint_reads_as_megatron_held_it(tmp_path, optstate_cli, run):
    """Megatron-LM's legacy checkpoint (`--ckpt-format torch`: iter_N/mp_rank_<tp>/model_optim_rng.pt,
    torch.save of the trainer's dict, the optimizer's params numbered, the model's state_dict
    beside): Megatron's mixed-precision optimizer (its fp32 main params in fp32_from_fp16_params) or
    its plain fp32 one, on one tensor-parallel rank or two (column- and row-parallel shards put
    together by Megatron's layer names; SwiGLU's fc1 shards each a rank's gate above its up), or
    its distributed optimizer (distrib_optim.pt: each DDP buffer's main params and moments, flat,
    the params found where their main params round to the model's weights; over several buckets
    under tensor parallel 2), over pipeline stages too (each stage's layers numbered on from the
    stages before it, 1 and 2 layers of 3 under tensor parallel 2 x data parallel 2; the last
    stage's copy of a tied embedding read once), also under a virtual pipeline (each stage's
    file holds model0 and model1, each numbering its layers from 0: chunk 0's layers of every
    stage, then chunk 1's, as Megatron interleaves them): bit for bit what Megatron's optimizer held, the
    params named as the model names them, in Megatron's two groups. The checkpoints folder (its
    tracker file), the iteration folder and, on one rank, the rank's folder and files read alike;
    one rank's file of several is refused, naming the folder to read."""
    ck = MEGATRON / run
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert info["format"] == "megatron"
    assert info["read_notes"][0] == ("Megatron-LM's save folder: latest_checkpointed_iteration.txt names "
                                     "iter_0000003/, the iteration read"), info["read_notes"]
    assert [g["weight_decay"] for g in info["param_groups"]] == [0.1, 0.0]
    mixed = run not in ("legacy_fp32_dp2",)
    assert any("fp32 main params" in n for n in info["read_notes"]) == mixed, info["read_notes"]
    distributed = run.endswith("distopt")
    assert any("Megatron's distributed optimizer keeps no param's place" in n
               for n in info["read_notes"]) == distributed, info["read_notes"]
    root = hashes_root(optstate_cli, ck)
    rank0 = ck / "iter_0000003" / "mp_rank_00"
    assert hashes_root(optstate_cli, ck / "iter_0000003") == root
    assert any("tied to it" in n for n in info["read_notes"]) == (run in ("legacy_pp2", "legacy_pp2_vp2",
                                                                         "legacy_pp2_vp2_dp2_distopt")), info["read_notes"]
    if "pp2" in run:
        rank0 = ck / "iter_0000003" / "mp_rank_00_000"
    if "tp2" in run or "pp2" in run:
        err = run_err(optstate_cli, "inspect", rank0 / "model_optim_rng.pt")
        assert "one model-parallel rank's part of a Megatron-LM checkpoint of" in err, err
        assert str(ck / "iter_0000003") in err
        if not distributed:  # ... also out of its folder, read by the torch.save driver
            shutil.copy(rank0 / "model_optim_rng.pt", tmp_path / "rank0.pt")
            err = run_err(optstate_cli, "inspect", tmp_path / "rank0.pt")
            assert "one model-parallel rank's file of a Megatron-LM checkpoint" in err, err
    else:
        assert hashes_root(optstate_cli, rank0) == root
        assert hashes_root(optstate_cli, rank0 / "model_optim_rng.pt") == root
        if distributed:
            assert hashes_root(optstate_cli, rank0 / "distrib_optim.pt") == root
    # written as a DCP torch reads; read back the same
    out = tmp_path / "dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0


@pytest.mark.parametrize("run,remove,why", [
    ("legacy_tp2", "mp_rank_00", "mp_rank_00 has no model_optim_rng.pt (1 stage of 2 tensor-parallel ranks found)"),
    # the last rank's folder leaves no hole in the grid: the args of the rank left say how many there were
    ("legacy_tp2", "mp_rank_01", "its args say tensor_model_parallel_size 2; {iter} holds 1 tensor-parallel rank"),
    ("legacy_tp2_pp2_dp2_distopt", "mp_rank_01_000",
     "mp_rank_01_000 has no model_optim_rng.pt (2 stages of 2 tensor-parallel ranks found)"),
    ("legacy_tp2_pp2_dp2_distopt", "mp_rank_00_001 mp_rank_01_001",  # the last stage
     "its args say pipeline_model_parallel_size 2; {iter} holds 1 pipeline stage"),
    ("legacy_tp2_pp2_dp2_distopt", "mp_rank_01_001/distrib_optim.pt",
     "its args say use_distributed_optimizer True, and no distrib_optim.pt (the distributed optimizer's state) is "
     "beside it")])
def test_a_megatron_legacy_checkpoint_missing_a_ranks_file_is_refused_naming_it(tmp_path, optstate_cli, run, remove,
                                                                          why):
    """A model-parallel rank's folder or its distributed optimizer's file missing from a legacy
    Megatron-LM checkpoint is an error naming what is missing (a hole in the grid of rank folders,
    or fewer ranks than the args saved in each rank's file say), never the ranks that are there
    read as the whole model."""
    ck = tmp_path / run
    shutil.copytree(MEGATRON / run, ck)
    iteration = ck / "iter_0000003"
    for name in remove.split():
        gone = iteration / name
        shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    want = why.format(iter=iteration)
    for command in ("inspect", "hash"):
        err = run_err(optstate_cli, command, ck)
        assert want in err, (command, err)
    validated = optstate_cli("validate", ck, check=False)  # a checkpoint that cannot be read: a finding
    assert validated.returncode == 1 and "FINDING" in validated.stdout and want in validated.stdout, validated


@pytest.mark.parametrize("run", ["legacy_moe_dp2", "legacy_moe_ep2", "legacy_moe_ep2_distopt",
                                 "legacy_moe_tp2_ep2_dp2_distopt", "legacy_moe_pp2_ep2", "legacy_moe_pp2_vp2_ep2"])
def test_a_megatron_legacy_mixture_of_experts_reads_as_megatron_held_it(tmp_path, optstate_cli, run):
    """A mixture of experts (2 a layer) in Megatron-LM's legacy checkpoint: without expert parallelism
    its experts are the dense optimizer's params; under expert parallelism 2 the experts' params are
    an optimizer of their own (Megatron's chain: the trainer dict's 'optimizer' a list of two
    state_dicts, each numbering its params from 0; distrib_optim.pt a list of two states, the dense
    one None in expert rank 1's folder), and each expert rank's folder mp_rank_<tp>_<ep> holds its
    experts numbered from 0 beside the dense params. Read bit for bit as Megatron held it, the
    experts numbered over the whole layer (local_experts.1 from expert rank 1), the experts' group
    after the dense params' two, also under tensor parallel 2 (the experts split as the dense
    layers) and over pipeline stages (mp_rank_00_<pp>_<ep>: layers numbered on, then experts), also
    under a virtual pipeline (each stage's model0, model1 chunks: layers interleaved over the chunks,
    then experts). One expert rank's folder is refused, naming the iteration folder."""
    ck = MEGATRON / run
    ref, meta = ref_of(ck)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    assert info["format"] == "megatron"
    assert info["read_notes"][0] == ("Megatron-LM's save folder: latest_checkpointed_iteration.txt names "
                                     "iter_0000003/, the iteration read"), info["read_notes"]
    chain = "ep2" in run
    groups = info["param_groups"]
    assert [g["weight_decay"] for g in groups] == ([0.1, 0.0, 0.1] if chain else [0.1, 0.0])
    experts = {n for n in info["params"] if ".mlp.experts." in n}
    assert {n.split(".local_experts.")[1].split(".")[0] for n in experts} == {"0", "1"}
    if chain:
        assert {info["params"][n]["group"] for n in experts} == {2}
        assert {info["params"][n]["group"] for n in info["params"] if n not in experts} == {0, 1}
    assert any("chain of 2 optimizers" in n for n in info["read_notes"]) == chain, info["read_notes"]
    assert hashes_root(optstate_cli, ck / "iter_0000003") == hashes_root(optstate_cli, ck)
    if chain:
        rank = ck / "iter_0000003" / {"legacy_moe_tp2_ep2_dp2_distopt": "mp_rank_01_001",
                                      "legacy_moe_pp2_ep2": "mp_rank_00_001_001",
                                      "legacy_moe_pp2_vp2_ep2": "mp_rank_00_001_001"}.get(run, "mp_rank_00_001")
        err = run_err(optstate_cli, "inspect", rank)
        assert "one model-parallel rank's part of a Megatron-LM checkpoint of" in err, err
        if "distopt" not in run:  # ... also out of its folder, read by the torch.save driver
            shutil.copy(rank / "model_optim_rng.pt", tmp_path / "rank.pt")
            err = run_err(optstate_cli, "inspect", tmp_path / "rank.pt")
            assert "expert_model_parallel_size 2" in err, err
    out = tmp_path / "dcp"
    optstate_cli("convert", ck, out, "--format", "dcp")
    assert optstate_cli("diff", ck, out).returncode == 0


def test_a_megatron_legacy_checkpoint_missing_a_rank_or_splitting_an_unknown_layer_is_refused(tmp_path, optstate_cli):
    """A legacy checkpoint saved without the optimizer (--no-save-optim), or one whose rank folders
    disagree with its args (a tensor-parallel rank's or a pipeline stage's folder missing, a
    virtual pipeline stage's file without one of its model chunks), or whose param tensor parallelism splits under a name Megatron's layers do not
    have (its weights differ between the ranks' files), is refused by name: neither reads shards
    as whole params."""
    ck = tmp_path / "ck"
    shutil.copytree(MEGATRON / "legacy_tp2", ck)
    shutil.rmtree(ck / "iter_0000003" / "mp_rank_01")
    err = run_err(optstate_cli, "inspect", ck)
    assert "its args say tensor_model_parallel_size 2" in err and "holds 1 tensor-parallel rank" in err, err
    ck = tmp_path / "stage"
    shutil.copytree(MEGATRON / "legacy_pp2", ck)
    shutil.rmtree(ck / "iter_0000003" / "mp_rank_00_001")
    err = run_err(optstate_cli, "inspect", ck)
    assert "its args say pipeline_model_parallel_size 2" in err and "holds 1 pipeline stage" in err, err
    ck = tmp_path / "weights_only"  # --no-save-optim
    shutil.copytree(MEGATRON / "legacy_dp2", ck)
    edit_rank_files(tmp_path, 'del d["optimizer"], d["opt_param_scheduler"]',
                    ck / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    err = run_err(optstate_cli, "inspect", ck)
    assert "Megatron's trainer dict without 'optimizer' (saved with --no-save-optim" in err, err
    ck = tmp_path / "chunk"  # a virtual pipeline stage's file without its second model chunk
    shutil.copytree(MEGATRON / "legacy_pp2_vp2", ck)
    edit_rank_files(tmp_path, 'del d["model1"]', ck / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt")
    err = run_err(optstate_cli, "inspect", ck)
    assert "its args say virtual_pipeline_model_parallel_size 2, and it holds 1 model chunk" in err, err
    ck = tmp_path / "renamed"
    shutil.copytree(MEGATRON / "legacy_tp2", ck)
    edit_rank_files(tmp_path, 'd["model"] = {k.replace("linear_proj", "my_out"): v for k, v in d["model"].items()}',
                    *sorted((ck / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt")))
    err = run_err(optstate_cli, "inspect", ck)
    assert "decoder.layers.0.self_attention.my_out.weight': its weights differ from tensor-parallel rank 0's" in err, err


def test_a_megatron_legacy_mixture_of_experts_whose_expert_ranks_disagree_is_refused(tmp_path, optstate_cli):
    """Under expert parallelism each expert rank's folder holds its experts and a copy of the dense
    params: a missing expert rank's folder, an expert rank's file of another checkpoint (its dense
    layer norms' weights differ from expert rank 0's), a distrib_optim.pt without the dense state
    where expert rank 0's folder must hold it, and experts split over other tensor-parallel ranks
    than the dense layers (expert_tensor_parallel_size) are each refused by name, never read as
    another rank's experts."""
    iteration = "iter_0000003"
    ck = tmp_path / "missing"
    shutil.copytree(MEGATRON / "legacy_moe_ep2", ck)
    shutil.rmtree(ck / iteration / "mp_rank_00_001")
    err = run_err(optstate_cli, "inspect", ck)
    assert "its args say expert_model_parallel_size 2" in err and "holds 1 expert-parallel rank" in err, err
    ck = tmp_path / "other"
    shutil.copytree(MEGATRON / "legacy_moe_ep2", ck)
    # a dense layer norm's main params
    edit_rank_files(tmp_path, 'd["optimizer"][0]["fp32_from_fp16_params"][1][0].add_(1.0)',
                    ck / iteration / "mp_rank_00_001" / "model_optim_rng.pt")
    err = run_err(optstate_cli, "inspect", ck)
    assert "a dense param whose weights differ from expert rank 0's" in err and "mp_rank_00_001" in err, err
    ck = tmp_path / "dense_state"
    shutil.copytree(MEGATRON / "legacy_moe_ep2_distopt", ck)
    shutil.copy(ck / iteration / "mp_rank_00_001" / "distrib_optim.pt", ck / iteration / "mp_rank_00_000")
    err = run_err(optstate_cli, "inspect", ck)
    assert "mp_rank_00_000/distrib_optim.pt [0]: None, where the dense params' state belongs" in err, err
    ck = tmp_path / "etp"
    shutil.copytree(MEGATRON / "legacy_moe_tp2_ep2_dp2_distopt", ck)
    edit_rank_files(tmp_path, 'd["args"].expert_tensor_parallel_size = 1',
                    *sorted((ck / iteration).glob("mp_rank_*/model_optim_rng.pt")))
    err = run_err(optstate_cli, "inspect", ck)
    assert "expert_tensor_parallel_size 1 beside tensor_model_parallel_size 2" in err, err


def test_a_megatron_legacy_distributed_optimizer_whose_weights_or_state_are_missing_is_refused(tmp_path, optstate_cli):
    """The distributed optimizer's legacy checkpoint keeps no param's place in its buffers: where the
    model's weights do not match the main params where Megatron lays a param out, the read is
    refused naming the param (never a param read from another's place); without distrib_optim.pt
    beside model_optim_rng.pt, the args' use_distributed_optimizer names what is missing."""
    ck = tmp_path / "ck"
    shutil.copytree(MEGATRON / "legacy_dp2_distopt", ck)
    rank0 = ck / "iter_0000003" / "mp_rank_00"
    edit_rank_files(tmp_path, 'd["model"]["decoder.layers.1.mlp.linear_fc1.weight"].view(-1)[0] += 1.0',
                    rank0 / "model_optim_rng.pt")
    err = run_err(optstate_cli, "inspect", ck)
    assert "do not round to the weights of 'decoder.layers.1.mlp.linear_fc1.weight'" in err, err
    shutil.copytree(MEGATRON / "legacy_dp2_distopt", tmp_path / "nostate")
    (tmp_path / "nostate" / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt").unlink()
    err = run_err(optstate_cli, "inspect", tmp_path / "nostate")
    assert "its args say use_distributed_optimizer True, and no distrib_optim.pt" in err, err
