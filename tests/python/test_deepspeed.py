"""DeepSpeed ZeRO checkpoints (formats/deepspeed/) against DeepSpeed itself: real runs on CPU ranks
(gloo), saved with engine.save_checkpoint. What optstate reads is compared with DeepSpeed's own
reassembly of the same checkpoint (its ds_to_universal: per-param fp32 weights, moments and step)
bit for bit, and the converted state, loaded into plain torch.optim.AdamW in one process, ends
where DeepSpeed's own run continues to, bit for bit."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import forkserver
from test_formats import hashes, run_err, run_script

SEEDS = Path(__file__).resolve().parents[2] / "formats" / "deepspeed" / "testdata"

pytest.importorskip("deepspeed")

# fp16 runs: a dynamic loss scale that halves on an overflow and doubles after 2 steps without one.
# From 2^29 ("fp16") the 4th step (the first after the checkpoint) overflows and is skipped; from 2^32
# ("fp16-unstepped") the first 4 overflow (the checkpoint, after 3, holds no optimizer state) and the
# 5th goes through. Either way, resuming is exact only where the loss scaler's state came through.
FP16 = """
def fp16(half):
    return {"enabled": half.startswith("fp16"), "initial_scale_power": 32 if half == "fp16-unstepped" else 29,
            "loss_scale_window": 2, "hysteresis": 1}
HALF = {"bf16": torch.bfloat16, "bf16-offload": torch.bfloat16, "fp16": torch.float16, "fp16-unstepped": torch.float16}


# The engine. "bf16-offload": optimizer state offloaded to the CPU (ZeRO-3: params too; ZeRO-1/2:
# with round_robin_gradients, which deals params to ranks out of order), as Hugging Face's offload
# configs do, and so DeepSpeed's own DeepSpeedCPUAdam from the config (offload takes no client
# optimizer; it keeps each step as a Python int), given the client's groups.
def initialize(model, opt, cfg, half):
    cfg["bf16"] = {"enabled": half.startswith("bf16")}
    if half.startswith("fp16"):
        # DeepSpeed's CPU accelerator takes fp16 only where oneDNN has fp16 kernels (AVX512-FP16,
        # AMX); torch's fp16 math runs on any CPU, slower, and DeepSpeed's fp16 engine and checkpoint
        # are the same: allowed here on a CPU without them.
        from deepspeed.accelerator import get_accelerator
        if not get_accelerator().is_fp16_supported():
            type(get_accelerator()).is_fp16_supported = lambda self: True
    if half == "bf16-offload":
        zero = cfg["zero_optimization"]
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
        else:
            zero["round_robin_gradients"] = True
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "lr": g["lr"]} for g in opt.param_groups]
        return deepspeed.initialize(model=model, model_parameters=groups, config=cfg)[0]
    return deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
"""

# The model and optimizer of every DeepSpeed run here: Hugging Face's two groups (weights decayed,
# the rest not); sizes that split across the ranks' partitions at odd places.
BUILD = """
def build(seed, frozen=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 50), torch.nn.GELU(),
                                torch.nn.Linear(50, 3))
    model[0].requires_grad_(not frozen)  # frozen: as a LoRA run's base model
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trained if p.dim() > 1], "weight_decay": 0.05},
              {"params": [p for p in trained if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-3}]
    return model, torch.optim.AdamW(groups, lr=1e-3)
"""

TRAIN = """
import sys, torch, deepspeed
stage, half, out, steps, more = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
sub_group_size = int(sys.argv[6]) if len(sys.argv) > 6 else 0
frozen = len(sys.argv) > 7 and sys.argv[7] == "frozen"
deepspeed.init_distributed(dist_backend="gloo")
""" + BUILD + FP16 + """
model, opt = build(0, frozen)
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "zero_optimization": {"stage": stage}, "fp16": fp16(half)}
if sub_group_size:
    cfg["zero_optimization"]["sub_group_size"] = sub_group_size
engine = initialize(model, opt, cfg, half)
dtype = HALF.get(half, torch.float32)
def step(s):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))  # every rank the same batch
    engine.backward((engine(x.to(dtype)).float() * 1e-2).square().sum())
    engine.step()
for s in range(steps):
    step(s)
engine.save_checkpoint(out)
for s in range(steps, steps + more):  # the run continues: its fp32 weights at the end, for the resume test
    step(s)
if more:
    def fp32(p):  # without ZeRO (stage 0, fp32) the param is its own fp32 copy; DeepSpeed gives None
        full = deepspeed.utils.safe_get_full_fp32_param(p)
        return (p.detach() if full is None else full).clone()
    full = {n: fp32(p) for n, p in model.named_parameters() if p.requires_grad}
    full["skipped steps"] = torch.tensor(engine.skipped_steps)
    if frozen:  # the frozen params' values, gathered from every rank's partition
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            full.update({n + " (module)": p.detach().clone() for n, p in model.named_parameters()})
    if torch.distributed.get_rank() == 0:
        torch.save(full, out + ".continued.pt")
torch.distributed.barrier()
"""


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def ds_run(tmp_path, stage, dtype, ranks, steps=3, more=0, sub_group_size=0, frozen=False):
    out = tmp_path / f"zero{stage}_{dtype}_{ranks}"
    run_script(tmp_path, TRAIN, "ds_train.py", stage, dtype, out, steps, more, sub_group_size,
               "frozen" if frozen else "-", ranks=ranks)
    return out


def universal(tmp_path, ck, tag):
    """DeepSpeed's own reassembly of a ZeRO checkpoint: zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt."""
    out = tmp_path / (ck.name + "_universal")
    proc = forkserver.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ck / tag),
                           "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
                           "--inject_missing_state"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def universal_tensor(path):
    t = torch.load(path, weights_only=False)
    return t["param"] if isinstance(t, dict) else t


def plain_is_ds_to_universal(tmp_path, optstate_cli, ck):
    """Asserts that tmp_path/plain.pt (optstate's convert of `ck` to a torch.optim.AdamW state_dict:
    every param at step 3, weights under "model", Hugging Face's two groups at lr 1e-3 and 2e-3) holds
    per param, bit for bit, what DeepSpeed's ds_to_universal makes of `ck`, which reads as the same
    state; returns the params' names in order."""
    sd = torch.load(tmp_path / "plain.pt")
    ref = universal(tmp_path, ck, "global_step3")
    assert hashes(optstate_cli, ref) == hashes(optstate_cli, ck)
    groups = sd["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0] and [g["lr"] for g in groups] == [1e-3, 2e-3]
    names = [n for g in groups for n in g["param_names"]]
    for i, n in enumerate(names):
        st = sd["optimizer"]["state"][i]
        assert st["step"].item() == 3
        if (ref / "zero" / n / "step.pt").exists():  # ZeRO-3's reassembly keeps none per param
            assert universal_tensor(ref / "zero" / n / "step.pt") == 3
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], universal_tensor(ref / "zero" / n / f"{k}.pt").view_as(st[k])), (n, k)
        assert torch.equal(sd["model"][n], universal_tensor(ref / "zero" / n / "fp32.pt").view_as(sd["model"][n])), n
    return names


@pytest.mark.parametrize("stage,dtype,ranks", [(1, "bf16", 2), (2, "fp32", 3), (3, "fp32", 3), (2, "fp16", 2)])
def test_zero_checkpoint_reads_as_deepspeeds_own_reassembly(tmp_path, optstate_cli, stage, dtype, ranks):
    ck = ds_run(tmp_path, stage, dtype, ranks)
    assert f"(deepspeed, files of {ranks} ranks)" in optstate_cli("inspect", ck).stdout
    done = optstate_cli("convert", ck, tmp_path / "plain.pt")  # HF's checkpoint-N/ layout: `latest` names the tag
    assert "['module']" in done.stderr  # the model's own weights: named as not read (the fp32 copies are)
    # DeepSpeed's universal checkpoint reads as the same state (optstate's own: the next test)
    names = plain_is_ds_to_universal(tmp_path, optstate_cli, ck)
    assert names == ["0.weight", "2.weight", "4.weight", "0.bias", "2.bias", "4.bias"]
    # DeepSpeed's format is written only from a DeepSpeed checkpoint (a universal one: the next test)
    err = run_err(optstate_cli, "convert", tmp_path / "plain.pt", tmp_path / "back", "--format", "deepspeed")
    assert "written from a DeepSpeed ZeRO checkpoint" in err and not (tmp_path / "back").exists()


RESUME_UNIVERSAL = """
import sys, torch, deepspeed
load_dir, tags, out, stage, half = sys.argv[1], sys.argv[2].split(","), sys.argv[3], int(sys.argv[4]), sys.argv[5]
deepspeed.init_distributed(dist_backend="gloo")
""" + BUILD + FP16 + """
dtype = HALF.get(half, torch.float32)
runs = []
for tag in tags:  # each universal checkpoint loaded into a fresh engine, two more steps
    model, opt = build(1)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "fp16": fp16(half), "checkpoint": {"load_universal": True}}
    engine = initialize(model, opt, cfg, half)
    engine.load_checkpoint(load_dir, tag=tag)
    assert engine.global_steps == 3
    for s in range(3, 5):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))
        engine.backward((engine(x.to(dtype)).float() * 1e-2).square().sum())
        engine.step()
    runs.append({n: deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()})
if torch.distributed.get_rank() == 0:
    torch.save(runs, out)
torch.distributed.barrier()
"""


def same_param_files(ref, ours):
    """Asserts that the per-param files of two universal checkpoints (zero/<name>/*.pt) are the same
    files holding equal tensors; returns the names."""
    params = sorted(p.name for p in (ref / "zero").iterdir() if p.is_dir())
    assert params == sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir())
    for n in params:
        files = sorted(f.name for f in (ref / "zero" / n).iterdir())
        assert files == sorted(f.name for f in (ours / "zero" / n).iterdir()), n
        for f in files:
            x = torch.load(ref / "zero" / n / f, weights_only=False)
            y = torch.load(ours / "zero" / n / f, weights_only=False)
            if isinstance(x, dict):
                assert x.keys() == y.keys() and x.get("cat_dim") == y.get("cat_dim"), (n, f)
                x, y = x["param"], y["param"]
            if not torch.is_tensor(x):  # step.pt of DeepSpeed's CPU Adam: an int
                assert type(x) is type(y) and x == y, (n, f, x, y)
                continue
            assert x.dtype == y.dtype and torch.equal(x, y), (n, f)
    return params


@pytest.mark.parametrize("stage,dtype", [(2, "fp32"), (1, "bf16"), (2, "fp16"), (2, "fp16-unstepped"),
                                         (2, "bf16-offload")])
def test_universal_checkpoint_is_ds_to_universals_and_deepspeed_resumes_it_on_other_world_sizes(
        tmp_path, optstate_cli, stage, dtype):
    """`convert --format deepspeed` of a ZeRO-1/2 checkpoint writes DeepSpeed's universal checkpoint:
    the files ds_to_universal writes (zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt, equal tensor
    for tensor; zero/optimizer_state.pt with the same settings; the model states file as it was).
    DeepSpeed, with "load_universal", resumes from it on 1 and on 3 ranks (bf16 and fp16: on 3; with
    CPU offload: on 1) exactly
    as from its own conversion (fp16: with the loss scaler's state, FP16) (a 2-rank checkpoint: DeepSpeed itself refuses another world size
    without one)."""
    ck = ds_run(tmp_path, stage, dtype, 2)
    ref = universal(tmp_path, ck, "global_step3")
    ours = tmp_path / "ours_universal"
    out = optstate_cli("convert", ck, ours, "--format", "deepspeed")
    assert "(deepspeed, 1 rank)" in out.stdout, out.stdout
    assert hashes(optstate_cli, ours) == hashes(optstate_cli, ck) == hashes(optstate_cli, ref)
    optstate_cli("validate", ours)
    assert (ours / "mp_rank_00_model_states.pt").read_bytes() == (ref / "mp_rank_00_model_states.pt").read_bytes()
    a = torch.load(ref / "zero" / "optimizer_state.pt", weights_only=False)
    b = torch.load(ours / "zero" / "optimizer_state.pt", weights_only=False)
    assert list(a) == list(b) and a["param_groups"] == b["param_groups"] and a["ds_version"] == b["ds_version"]
    assert vars(a["loss_scaler"]) == vars(b["loss_scaler"]) and a["zero_stage"] == b["zero_stage"]
    assert len(same_param_files(ref, ours)) == 6
    for world in {"fp32": (1, 3), "bf16-offload": (1,)}.get(dtype, (3,)):  # offload: 1 rank (CI's time)
        res = tmp_path / f"resumed{world}.pt"
        run_script(tmp_path, RESUME_UNIVERSAL, "resume_universal.py", tmp_path, f"{ref.name},{ours.name}", res,
                   stage, dtype, ranks=world, distributed=True)
        theirs, mine = torch.load(res)
        assert all(torch.equal(theirs[n], mine[n]) for n in theirs), world


def test_the_checkpoints_folder_names_its_universal_checkpoint_by_latest_universal(tmp_path, optstate_cli):
    """ds_to_universal writes `latest_universal` beside its output folder, naming it, as DeepSpeed's
    `latest` names a ZeRO tag: the folder that holds it reads as that universal checkpoint. Beside
    a `latest` (in the checkpoints folder of the run converted) the tag `latest` names is read, as
    DeepSpeed's load_checkpoint does by default: a run that went on after its conversion has a
    newer one. A name that leaves the folder is not followed."""
    ck = ds_run(tmp_path, 2, "fp32", 2)
    ref = universal(tmp_path, ck, "global_step3")  # tmp_path/<ck>_universal, tmp_path/latest_universal
    assert (tmp_path / "latest_universal").read_text() == ref.name
    want = hashes(optstate_cli, ref)
    assert want == hashes(optstate_cli, ck)
    assert hashes(optstate_cli, tmp_path) == want
    assert "(deepspeed)" in optstate_cli("inspect", tmp_path).stdout
    notes = json.loads(optstate_cli("inspect", tmp_path, "--json").stdout)["read_notes"]
    assert notes[:1] == [f"DeepSpeed's save folder: latest_universal names {ref.name}/, the tag read"], notes
    assert not any("save folder" in n for n in json.loads(optstate_cli("inspect", ref, "--json").stdout)["read_notes"])
    # in the checkpoints folder beside `latest`: read through either name, `latest` first
    shutil.move(ref, ck / "global_step3_universal")
    (ck / "latest_universal").write_text("global_step3_universal")
    assert hashes(optstate_cli, ck) == want
    (ck / "latest").rename(ck / "latest.aside")
    assert hashes(optstate_cli, ck) == want
    (ck / "latest.aside").rename(ck / "latest")
    notes = json.loads(optstate_cli("inspect", ck, "--json").stdout)["read_notes"]
    assert notes[:1] == ["DeepSpeed's save folder: latest names global_step3/, the tag read"], notes
    moment = ck / "global_step3_universal" / "zero" / "0.weight" / "exp_avg.pt"
    moment.unlink()  # the universal checkpoint damaged: the ZeRO one is what reads
    assert hashes(optstate_cli, ck) == want
    (ck / "latest").unlink()
    err = run_err(optstate_cli, "inspect", ck)
    assert "global_step3_universal" in err and "0.weight" in err, err
    for bad in ("..", "../" + ck.name, "/etc", ""):
        (ck / "latest_universal").write_text(bad)
        assert optstate_cli("inspect", ck, check=False).returncode == 2, bad


def test_universal_checkpoint_holds_frozen_params_and_buffers_as_ds_to_universal_writes_them(tmp_path, optstate_cli):
    """A LoRA-like run (a frozen Linear; a float and an int64 buffer; bf16 ZeRO-1: the seed
    frozen_bf16_zero1_world2): the module tensors no param group holds are written as
    zero/<name>/fp32.pt ({"param": tensor.float()}) as ds_to_universal writes them, file for file."""
    seed = SEEDS / "frozen_bf16_zero1_world2"
    ref = universal(tmp_path, seed, "global_step3")
    ours = tmp_path / "ours_universal"
    out = optstate_cli("convert", seed, ours, "--format", "deepspeed")
    assert "carried unchanged: ['module']" in out.stdout, out.stdout
    names = same_param_files(ref, ours)
    assert {"0.weight", "0.bias", "scale", "seen"} < set(names) and len(names) == 8
    assert torch.load(ours / "zero" / "seen" / "fp32.pt")["param"].tolist() == [3.0, -5.0, float(1 << 40)]
    assert hashes(optstate_cli, ours) == hashes(optstate_cli, seed)


def test_optimizer_deepspeed_built_is_read_only_as_adamw(tmp_path, optstate_cli):
    """DeepSpeed's FusedAdam and CPUAdam keep Adam's L2 mode outside their param groups: only the
    model states' ds_config tells ("Adam", adam_w_mode false; the seed adam_l2_zero2_world2). With
    weight decay that is another update than AdamW's: refused, as is any optimizer but Adam/AdamW."""
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(SEEDS / "adam_l2_zero2_world2" / "global_step3", ck)
    model = ck / "mp_rank_00_model_states.pt"
    assert "Adam's L2 decay, not AdamW's decoupled decay" in run_err(optstate_cli, "inspect", ck)

    def with_optimizer(opt):
        sd = torch.load(model, weights_only=False)
        sd["ds_config"]["optimizer"] = opt
        torch.save(sd, model)

    with_optimizer({"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01}})  # its state: exp_avg, exp_avg_sq too
    assert "ds_config's optimizer is 'Lamb', not Adam or AdamW" in run_err(optstate_cli, "inspect", ck)
    with_optimizer({"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "adam_w_mode": False}})
    assert "(deepspeed, files of 2 ranks)" in optstate_cli("inspect", ck).stdout  # "AdamW" forces AdamW's update


RESUME_ZERO3 = """
import sys, torch, deepspeed
load_dir, tag, out, sub_group_size, half = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
frozen = sys.argv[6] == "frozen"
deepspeed.init_distributed(dist_backend="gloo")
""" + BUILD + FP16 + """
model, opt = build(1, frozen)
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "zero_optimization": {"stage": 3, "sub_group_size": sub_group_size}, "fp16": fp16(half)}
dtype = HALF[half]
engine = initialize(model, opt, cfg, half)
engine.load_checkpoint(load_dir, tag=tag)  # DeepSpeed's own load: the world size must be the files'
assert engine.global_steps == 3
for s in range(3, 5):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))
    engine.backward((engine(x.to(dtype)).float() * 1e-2).square().sum())
    engine.step()
full = {n: deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters() if p.requires_grad}
full["skipped steps"] = torch.tensor(engine.skipped_steps)
if frozen:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        full.update({n + " (module)": p.detach().clone() for n, p in model.named_parameters()})
if torch.distributed.get_rank() == 0:
    torch.save(full, out)
torch.distributed.barrier()
"""


@pytest.mark.parametrize("half", ["bf16", "bf16-offload", "fp16", "fp16-unstepped"])
def test_zero3_checkpoint_resharded_resumes_in_deepspeed_on_other_world_sizes(tmp_path, optstate_cli, half):
    """DeepSpeed loads a ZeRO-3 checkpoint only on its own world size, and its universal one with every
    group given group 0's hyperparameters. `convert --format deepspeed --world-size N` of a ZeRO-3
    checkpoint writes what DeepSpeed would have saved on N ranks (partitions, the sub-groups it forms
    from N ranks' partition sizes: 2000 elements here, so 3 flat params on 2 ranks, 2 on 4, 3 on 1;
    the frozen first layer's partitions), and DeepSpeed resumes a bf16 2-rank run from it on 4 and on
    1 rank to the uninterrupted run's weights bit for bit, fp32 master weights and the module's bf16
    ones, frozen included (worlds whose gradient averaging is exact: every rank here sees one batch).
    Likewise under fp16 (the loss scaler's state), and with optimizer state and params offloaded to
    the CPU (DeepSpeedCPUAdam), there without the frozen layer: with it, DeepSpeed's own
    uninterrupted offload runs on 1, 2 and 4 ranks differ from each other by 4e-9 (measured)."""
    frozen = half != "bf16-offload"
    ck = ds_run(tmp_path, 3, half, 2, more=2, sub_group_size=2000, frozen=frozen)
    continued = torch.load(str(ck) + ".continued.pt")
    # fp16: the run's 4th step overflowed at the loss scale it had reached (FP16), which a loss
    # scaler restarted at 2^29 would have taken; fp16-unstepped: its first 4 overflowed (the
    # checkpoint holds no optimizer state), and a loss scaler restarted at 2^32 would skip the 5th too
    assert continued["skipped steps"].item() == {"bf16": 0, "bf16-offload": 0, "fp16": 1, "fp16-unstepped": 4}[half]
    if half == "fp16-unstepped":  # read as the fp32 weights alone, at step 0
        entries = hashes(optstate_cli, ck)["entries"]
        assert len(entries) == 4 and all(e.endswith(".param") for e in entries), entries
    for world in (4, 1):
        tag = f"resharded{world}"
        out = optstate_cli("convert", ck, tmp_path / tag, "--format", "deepspeed", "--world-size", world)
        assert f"(deepspeed, {world} rank" in out.stdout, out.stdout
        assert hashes(optstate_cli, tmp_path / tag) == hashes(optstate_cli, ck)
        res = tmp_path / f"resumed{world}.pt"
        run_script(tmp_path, RESUME_ZERO3, "resume_zero3.py", tmp_path, tag, res, 2000, half,
                   "frozen" if frozen else "-", ranks=world, distributed=True)
        mine = torch.load(res)
        assert continued.keys() == mine.keys() and ("0.weight (module)" in mine) == frozen
        assert all(torch.equal(continued[n], mine[n]) for n in continued), world


def test_zero2_and_zero3_of_one_run_hold_the_same_state(tmp_path, optstate_cli):
    a, b = ds_run(tmp_path, 2, "fp32", 2), ds_run(tmp_path, 3, "fp32", 2)
    assert hashes(optstate_cli, a) == hashes(optstate_cli, b)
    # and resharded to any world size, it is still that state
    optstate_cli("reshard", a, tmp_path / "native3", "--world-size", "3")
    assert hashes(optstate_cli, tmp_path / "native3") == hashes(optstate_cli, a)


def continued_in_torch(sd, model_key="model"):
    """torch.optim.AdamW over BUILD's model from a converted state_dict (the weights at
    sd[model_key], the optimizer at sd["optimizer"], its groups naming their params), stepped twice
    more on the batches the DeepSpeed runs take at steps 3 and 4; returns (model, optimizer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 50), torch.nn.GELU(),
                                torch.nn.Linear(50, 3))
    model.load_state_dict(sd[model_key])
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [named[n] for n in g["param_names"]]} for g in sd["optimizer"]["param_groups"]],
                            lr=1.0)
    opt.load_state_dict(sd["optimizer"])
    for s in range(3, 5):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))
        (model(x) * 1e-2).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_converted_zero_state_resumes_in_torch_adamw_where_deepspeed_continues(tmp_path, optstate_cli):
    """ZeRO-2 on 2 ranks, every rank the same batch: DeepSpeed's averaged gradient is the
    one-process gradient exactly, so torch.optim.AdamW from the converted state, stepping on the
    same batches, must end on DeepSpeed's fp32 weights bit for bit."""
    ck = ds_run(tmp_path, 2, "fp32", 2, steps=3, more=2)
    optstate_cli("convert", ck, tmp_path / "plain.pt")
    model, _ = continued_in_torch(torch.load(tmp_path / "plain.pt"))
    continued = torch.load(str(ck) + ".continued.pt")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), continued[n]), n


STAGE0_RESUME = """
import sys, torch, deepspeed
load_dir, out = sys.argv[1], sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
""" + BUILD + FP16 + """
model, opt = build(1)  # other initial weights: all of them must come from the checkpoint
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "zero_optimization": {"stage": 0}, "fp16": fp16("fp32")}
engine = initialize(model, opt, cfg, "fp32")
engine.load_checkpoint(load_dir, tag="global_step3")
assert engine.global_steps == 3
for s in range(3, 5):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))
    engine.backward((engine(x) * 1e-2).square().sum())
    engine.step()
if torch.distributed.get_rank() == 0:
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out)
torch.distributed.barrier()
"""


@pytest.mark.parametrize("half", ["fp32", "bf16", "fp16"])
def test_checkpoint_without_zero_reads_its_model_states_file(tmp_path, optstate_cli, half):
    """Without ZeRO (stage 0) every rank holds the whole optimizer, and rank 0 saves it inside
    mp_rank_00_model_states.pt: torch's state_dict (fp32), or under bf16/fp16 the dict of DeepSpeed's
    FP16_UnfusedOptimizer (torch's state_dict within, each group's fp32 master params beside). Read
    with the params named after ['module'] (the state is numbered group by group), the masters as
    the weights, bit for bit what the file holds."""
    ck = ds_run(tmp_path, 0, half, 2)
    assert sorted(p.name for p in (ck / "global_step3").iterdir()) == ["mp_rank_00_model_states.pt"]
    info = optstate_cli("inspect", ck)
    assert "6 params" in info.stdout, info.stdout
    assert ("DeepSpeed's fp32 main params (['optimizer']['fp32_groups'])" in info.stdout) == (half != "fp32")
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    optstate_cli("convert", ck, tmp_path / "plain.safetensors")
    from safetensors.torch import load_file
    got = load_file(tmp_path / "plain.safetensors")
    raw = torch.load(ck / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    inner = raw["optimizer"] if half == "fp32" else raw["optimizer"]["optimizer_state_dict"]
    names = ["0.weight", "2.weight", "4.weight", "0.bias", "2.bias", "4.bias"]  # numbered group by group
    masters = ([raw["module"][n] for n in names] if half == "fp32"
               else [t for g in raw["optimizer"]["fp32_groups"] for t in g])
    for i, n in enumerate(names):
        st = inner["state"][i]
        assert st["exp_avg"].shape == raw["module"][n].shape
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"{n}.{k}"], st[k]), (n, k)
        assert torch.equal(got[f"{n}.param"], masters[i].float()), n
    if half != "fp32":
        assert raw["module"]["0.weight"].dtype == HALF_DTYPES[half]  # the copies that only name them
        # A write carrying the file would keep the masters as they were: torch.save output is plain.
        done = optstate_cli("convert", ck, tmp_path / "plain.pt")
        assert set(torch.load(tmp_path / "plain.pt", weights_only=False)) == {"model", "optimizer"}, done.stdout


HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def test_checkpoint_without_zero_converted_resumes_in_torch_and_deepspeed(tmp_path, optstate_cli):
    """fp32 without ZeRO on 2 ranks, every rank the same batch: torch.optim.AdamW from the converted
    state ends where DeepSpeed's run continues to, bit for bit; and the model states file written
    back by optstate (its other entries carried, the optimizer rewritten) resumes in DeepSpeed."""
    ck = ds_run(tmp_path, 0, "fp32", 2, steps=3, more=2)
    continued = torch.load(str(ck) + ".continued.pt")
    # A torch.save: the file's layout kept (the model under ['module'], DeepSpeed's other entries
    # carried), the optimizer torch's state_dict, its groups naming their params.
    optstate_cli("convert", ck, tmp_path / "plain.pt")
    model, _ = continued_in_torch(torch.load(tmp_path / "plain.pt", weights_only=False), "module")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), continued[n]), n
    # DeepSpeed's own tag folder, written back through optstate
    back = tmp_path / "back"
    (back / "global_step3").mkdir(parents=True)
    done = optstate_cli("convert", ck, back / "global_step3" / "mp_rank_00_model_states.pt")
    assert "['ds_config']" in done.stdout and "carried unchanged" in done.stdout, done.stdout
    run_script(tmp_path, STAGE0_RESUME, "stage0_resume.py", back, tmp_path / "resumed.pt", ranks=2)
    resumed = torch.load(tmp_path / "resumed.pt")
    for n in resumed:
        assert torch.equal(resumed[n], continued[n]), n


# DeepSpeed's FusedAdam from the ds_config without ZeRO: in fp32 the engine steps it as it is; under
# fp16/bf16 inside FP16_Optimizer, which keeps each group flat (fp32_groups_flat). Args: out, half
# ("fp32", "fp16", "bf16"), "frozen" (model[0] frozen) or "-".
STAGE0_FUSED = """
import sys, torch, deepspeed
out, half, frozen = sys.argv[1], sys.argv[2], sys.argv[3] == "frozen"
deepspeed.init_distributed(dist_backend="gloo")
""" + BUILD + FP16 + """
model, opt = build(0, frozen)
groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "lr": g["lr"]} for g in opt.param_groups]
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "fp16": fp16(half), "bf16": {"enabled": half == "bf16"}}
if half.startswith("fp16"):
    from deepspeed.accelerator import get_accelerator
    if not get_accelerator().is_fp16_supported():  # as in initialize(): the same engine, slower
        type(get_accelerator()).is_fp16_supported = lambda self: True
engine = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)[0]
kind = "FusedAdam" if half == "fp32" else "FP16_Optimizer"
assert type(engine.optimizer).__name__ == kind, type(engine.optimizer)
dtype = HALF.get(half, torch.float32)
def step(s):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))
    engine.backward((engine(x.to(dtype)).float() * 1e-2).square().sum())
    engine.step()
for s in range(3):
    step(s)
engine.save_checkpoint(out)
for s in range(3, 5):
    step(s)
if torch.distributed.get_rank() == 0:
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out + ".continued.pt")
torch.distributed.barrier()
"""


def test_deepspeed_fused_adam_without_zero_reads_each_group_at_its_last_params_step(tmp_path, optstate_cli):
    """DeepSpeed's FusedAdam (the ds_config's "optimizer", here without ZeRO and in fp32, so its
    state is saved per param) counts a group's steps on its last param's state only: the others
    keep step 0. Read at the group's count, the converted state resumes in torch.optim.AdamW where
    DeepSpeed's run continues to (within float rounding of the two kernels; the per-param counts as
    saved would take a first step's bias correction and land 3e-3 away: measured)."""
    ck = tmp_path / "fused"
    run_script(tmp_path, STAGE0_FUSED, "stage0_fused.py", ck, "fp32", "-", ranks=2)
    raw = torch.load(ck / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)["optimizer"]
    assert sorted(st["step"] for st in raw["state"].values()) == [0, 0, 0, 0, 3, 3]  # the quirk, as saved
    notes = [l for l in optstate_cli("inspect", ck).stdout.splitlines() if "DeepSpeed's FusedAdam counts" in l]
    assert len(notes) == 2 and all("(its params held 0, 3): all 3 read at step 3" in l for l in notes), notes
    optstate_cli("convert", ck, tmp_path / "plain.pt")
    sd = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert sorted(int(st["step"]) for st in sd["optimizer"]["state"].values()) == [3] * 6
    model, opt = continued_in_torch(sd, "module")
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 2e-3]
    continued = torch.load(str(ck) + ".continued.pt")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), continued[n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("half,frozen", [("fp16", False), ("bf16", False), ("fp16", True)])
def test_fp16_optimizer_flat_groups_are_split_into_the_models_params(tmp_path, optstate_cli, half, frozen):
    """fp16/bf16 without ZeRO around DeepSpeed's FusedAdam: FP16_Optimizer flattens each param group
    into one fp32 master (fp32_groups_flat) and its FusedAdam steps that one flat param, so the file
    names no param's place. Each param is found where its master rounds to the module's weights:
    the state read is the flat moments and masters cut at the group's params' bounds (the groups as
    BUILD gives them: weights, then biases, each in module order), bit for bit; a frozen layer is in
    no group. Weights that no longer match (another step's) are refused, naming the group and
    element."""
    ck = tmp_path / "fused16"
    run_script(tmp_path, STAGE0_FUSED, "stage0_fused.py", ck, half, "frozen" if frozen else "-", ranks=2)
    raw = torch.load(ck / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    wrapper = raw["optimizer"]
    assert "fp32_groups_flat" in wrapper and "fp32_groups" not in wrapper, list(wrapper)
    names = [["2.weight", "4.weight"], ["2.bias", "4.bias"]] if frozen else \
        [["0.weight", "2.weight", "4.weight"], ["0.bias", "2.bias", "4.bias"]]
    info = optstate_cli("inspect", ck).stdout
    assert f"{sum(map(len, names))} params" in info, info
    assert "each param found in module order where its fp32 master rounds to the module's weights" in info, info
    assert ("2 model tensors in no param group's flat master" in info) == frozen, info
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    optstate_cli("convert", ck, tmp_path / "plain.safetensors")
    from safetensors.torch import load_file
    got = load_file(tmp_path / "plain.safetensors")
    inner = wrapper["optimizer_state_dict"]
    for g, group in enumerate(names):
        numels = [raw["module"][n].numel() for n in group]
        assert sum(numels) == wrapper["fp32_groups_flat"][g].numel()
        cut = lambda flat: dict(zip(group, torch.split(flat, numels)))
        masters = cut(wrapper["fp32_groups_flat"][g])
        moments = {k: cut(inner["state"][g][k]) for k in ("exp_avg", "exp_avg_sq")}
        for n in group:
            shape = raw["module"][n].shape
            assert torch.equal(masters[n].to(HALF_DTYPES[half]).view(shape), raw["module"][n]), n  # DeepSpeed's
            assert torch.equal(got[f"{n}.param"], masters[n].view(shape)), n
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[f"{n}.{k}"], moments[k][n].view(shape)), (n, k)
            # the step as the file holds it: FP16_Optimizer's first (zero-gradient) step, then 3
            assert int(inner["state"][g]["step"]) == 4
    if frozen:
        return
    # the module's weights of another step: no placement
    raw["module"]["2.weight"] = (raw["module"]["2.weight"].float() * 1.5).to(HALF_DTYPES[half])
    bad = tmp_path / "bad" / "global_step3"
    bad.mkdir(parents=True)
    torch.save(raw, bad / "mp_rank_00_model_states.pt")
    err = run_err(optstate_cli, "inspect", bad)
    assert "param group 0's flat master (11094 elements) holds no model tensor at element 6144" in err, err


# 48 pre-norm blocks under bf16 without ZeRO around DeepSpeed's FusedAdam (FP16_Optimizer), lr 1e-5:
# after 3 steps every LayerNorm weight is still exactly 1.0 in bf16, 96 tensors of equal weights.
STAGE0_FUSED_BLOCKS = """
import sys, torch, deepspeed
out = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.fc1 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d)
        self.fc2, self.ln2 = torch.nn.Linear(2 * d, d), torch.nn.LayerNorm(d)
    def forward(self, x):
        return x + self.ln2(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln1(x)))))
model = torch.nn.Sequential(*[Block(64) for _ in range(48)], torch.nn.Linear(64, 8))
groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05},
          {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
       "bf16": {"enabled": True}}
engine = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)[0]
assert type(engine.optimizer).__name__ == "FP16_Optimizer", type(engine.optimizer)
for s in range(3):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))
    engine.backward(engine(x.bfloat16()).float().square().mean())
    engine.step()
engine.save_checkpoint(out)
"""


def test_fp16_optimizer_flat_groups_of_many_equal_layernorm_weights(tmp_path, optstate_cli):
    """386 tensors, 96 of them LayerNorm weights all exactly 1.0 in bf16 (so each fits every
    LayerNorm's place in the no-decay group's master): placed by module order, every param's
    master and moments the flat tensors cut by torch at the groups' params (as named_parameters
    lists them), bit for bit."""
    ck = tmp_path / "blocks"
    run_script(tmp_path, STAGE0_FUSED_BLOCKS, "stage0_blocks.py", ck, distributed=True)
    raw = torch.load(ck / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    module, wrapper = raw["module"], raw["optimizer"]
    assert sum(bool((v == 1).all()) for k, v in module.items() if ".ln" in k and k.endswith("weight")) == 96
    optstate_cli("convert", ck, tmp_path / "plain.safetensors")
    from safetensors.torch import load_file
    got = load_file(tmp_path / "plain.safetensors")
    assert len(got) == 3 * len(module) == 3 * 386
    groups = [[n for n in module if module[n].dim() > 1], [n for n in module if module[n].dim() <= 1]]
    for g, names in enumerate(groups):
        numels = [module[n].numel() for n in names]
        cuts = {"param": torch.split(wrapper["fp32_groups_flat"][g], numels)}
        for k in ("exp_avg", "exp_avg_sq"):
            cuts[k] = torch.split(wrapper["optimizer_state_dict"]["state"][g][k], numels)
        for i, n in enumerate(names):
            for k, parts in cuts.items():
                assert torch.equal(got[f"{n}.{k}"], parts[i].view(module[n].shape)), (n, k)


def test_checkpoint_without_zero_beside_model_parallel_files_is_refused(tmp_path, optstate_cli):
    ck = ds_run(tmp_path, 0, "fp32", 2)
    import shutil
    tag = ck / "global_step3"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    err = run_err(optstate_cli, "inspect", ck)
    assert "without ZeRO beside model-parallel ranks' files (mp_rank_01_model_states.pt)" in err, err
    (tag / "mp_rank_01_model_states.pt").unlink()
    # a universal checkpoint is written from ZeRO-1/2 ones only
    err = run_err(optstate_cli, "convert", ck, tmp_path / "u", "--format", "deepspeed")
    assert not (tmp_path / "u").exists(), err


def test_optimizer_state_on_some_flat_params_or_ranks_only_is_refused(tmp_path, optstate_cli):
    """A checkpoint whose optimizer never stepped holds no state (the seed fp16_unstepped_zero2_world2
    reads as its weights at step 0); all flat params and ranks step together, so state on some of them
    only is a damaged file, refused naming it."""
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(SEEDS / "zero2_world2" / "global_step3", ck)
    rank0 = ck / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = torch.load(rank0, weights_only=False)
    del sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    torch.save(sd, rank0)
    err = run_err(optstate_cli, "inspect", ck)
    assert f"{rank0} param group 1: flat param 1 has state, flat param 0 none" in err, err
    sd["optimizer_state_dict"]["base_optimizer_state"]["state"].clear()  # rank 0 never stepped, rank 1 did
    torch.save(sd, rank0)
    err = run_err(optstate_cli, "inspect", ck)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt flat param 0: group, moments or hyperparameters other" in err, err
    entries = hashes(optstate_cli, SEEDS / "fp16_unstepped_zero2_world2")["entries"]
    assert sorted(entries) == ["0.bias.param", "0.weight.param", "2.bias.param", "2.weight.param"]
    # "elastic_checkpoint": true keeps the wrapped optimizer's state per group, without param_groups
    # (checked on DeepSpeed 0.19.8's files): the hyperparameters are not there, so it is refused
    sd = torch.load(SEEDS / "zero2_world2" / "global_step3" / rank0.name, weights_only=False)
    osd = sd["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    osd["base_optimizer_state"] = [base["state"][i] for i in sorted(base["state"])]
    osd["base_optimizer_state_step"] = 3
    torch.save(sd, rank0)
    assert 'an elastic checkpoint ("elastic_checkpoint": true)' in run_err(optstate_cli, "inspect", ck)


BNB_TRAIN = """
import sys, torch, deepspeed, bitsandbytes as bnb
stage, out = int(sys.argv[1]), sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
""" + BUILD + """
model, opt = build(0)
opt = bnb.optim.AdamW8bit([{k: v for k, v in g.items() if k in ("params", "lr", "weight_decay")} for g in opt.param_groups],
                          lr=1e-3)
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
for s in range(3):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s))
    engine.backward((engine(x.to(torch.bfloat16)).float() * 1e-2).square().sum())
    engine.step()
engine.save_checkpoint(out)
torch.distributed.barrier()
"""


def bnb_partitions_by_param(tag, stage):
    """What DeepSpeed wrapping bitsandbytes holds, put together in Python: each rank's flat
    partition dequantized by bitsandbytes' own dequantize_blockwise (its blocks counted from the
    partition's start), cut into params by DeepSpeed's own records (ZeRO-1/2: param_slice_mappings;
    ZeRO-3: param_shapes, each param split in ceil(numel / world) parts), and the parts joined."""
    import math
    import bitsandbytes.functional as F
    files = sorted(tag.glob("*zero_pp_rank_*_optim_states.pt"), key=lambda f: int(f.name.split("rank_")[1].split("_")[0]))
    shapes = torch.load(next(tag.glob("*model_states.pt")), weights_only=False)["param_shapes"]
    full = {}
    for rank, f in enumerate(files):
        osd = torch.load(f, weights_only=False)["optimizer_state_dict"]
        base = osd["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
        weights = osd["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"]
        for k in range(len(weights)):
            quant = base["state"][k]["__bnb_optimizer_quant_state__"]
            parts = {"param": weights[k]}
            for entry, n in (("exp_avg", "1"), ("exp_avg_sq", "2")):
                codes = quant["state" + n]
                parts[entry] = codes if codes.dtype != torch.uint8 else F.dequantize_blockwise(
                    codes, absmax=quant["absmax" + n], code=quant["qmap" + n], blocksize=256)
            if stage == 3:
                runs, offset = {}, 0
                for name, shape in shapes[k].items():
                    part = -(-math.prod(shape) // len(files))
                    runs[name] = (offset, max(0, min(part, math.prod(shape) - rank * part)))
                    offset += part
            else:
                runs = {name: (a.start, a.numel) for name, a in osd["param_slice_mappings"][k].items()}
            for name, (start, count) in runs.items():
                for entry, v in parts.items():
                    full.setdefault(f"{name}.{entry}", []).append(v[start:start + count])
    return {k: torch.cat(v) for k, v in full.items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_bitsandbytes_adamw8bit_under_zero_reads_as_its_dequantized_partitions(tmp_path, optstate_cli, stage):
    """Hugging Face's optim="adamw_bnb_8bit" under DeepSpeed: ZeRO wraps bitsandbytes' AdamW8bit,
    whose state is 8-bit codes of each rank's flat partition in blocks of 256 counted from the
    partition's start (32-bit state for partitions under 4096 elements). optstate reads each param's
    moments as bitsandbytes' own dequantize_blockwise of those partitions gives them, bit for bit,
    and says so; DeepSpeed's own layouts of it (universal, another world size) are refused."""
    pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file
    ck = tmp_path / f"bnb_zero{stage}"
    run_script(tmp_path, BNB_TRAIN, "bnb_train.py", stage, ck, ranks=2)
    out = optstate_cli("convert", ck, tmp_path / "plain.safetensors")
    assert "bitsandbytes' 8-bit encoding of the moments" in out.stderr, out.stderr
    got, want = load_file(tmp_path / "plain.safetensors"), bnb_partitions_by_param(ck / "global_step3", stage)
    assert sorted(got) == sorted(want) and len(want) == 18
    for k in want:
        assert torch.equal(got[k].flatten(), want[k]), k
    if stage == 3:
        err = run_err(optstate_cli, "convert", ck, tmp_path / "w4", "--format", "deepspeed", "--world-size", "4")
        assert "the optimizer DeepSpeed wraps is bitsandbytes'" in err and not (tmp_path / "w4").exists()
    else:
        err = run_err(optstate_cli, "convert", ck, tmp_path / "u", "--format", "deepspeed")
        assert "a universal checkpoint holds fp32 exp_avg/exp_avg_sq" in err and not (tmp_path / "u").exists()


# DeepSpeed's pipeline (PipelineModule): `stages` stages over the ranks (the rest data-parallel), ZeRO-1;
# an embedding tied to the output head (TiedLayerSpec: held by the first and the last stage), Hugging
# Face's two groups (biases at another lr), 2 micro-batches a step; every data-parallel rank the same batch.
PIPE_BUILD = """
import sys, torch, deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
deepspeed.init_distributed(dist_backend="gloo")
class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(40, 64) * 0.1)
    def forward(self, x):
        return x @ self.weight.t()
def build(stages, seed):
    torch.manual_seed(seed)
    layers = [TiedLayerSpec("embed", Embed, tied_weight_attr="weight"), LayerSpec(torch.nn.Linear, 40, 96),
              torch.nn.GELU(), LayerSpec(torch.nn.Linear, 96, 50), LayerSpec(torch.nn.LayerNorm, 50),
              LayerSpec(torch.nn.Linear, 50, 40),
              TiedLayerSpec("embed", Embed, forward_fn=lambda embed, x: x @ embed.weight, tied_weight_attr="weight")]
    model = PipelineModule(layers=layers, num_stages=stages, partition_method="uniform",
                           loss_fn=lambda y, t: (y.float() * 1e-1 - t).square().mean())
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-3}]
    return model, torch.optim.AdamW(groups, lr=1e-3)
def config(half, zero, universal=False):
    if half == "fp16":
        from deepspeed.accelerator import get_accelerator
        if not get_accelerator().is_fp16_supported():  # as in FP16 above
            type(get_accelerator()).is_fp16_supported = lambda self: True
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": zero}, "bf16": {"enabled": half == "bf16"},
            "fp16": {"enabled": half == "fp16", "initial_scale_power": 8},
            "checkpoint": {"load_universal": universal}}
def step(engine, s, half):
    g = torch.Generator().manual_seed(s)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(half, torch.float32)
    batches = [(torch.randn(4, 64, generator=g).to(dtype), torch.randn(4, 64, generator=g)) for _ in range(2)]
    engine.train_batch(data_iter=iter(batches))
def dump(engine, model, out):  # each stage's fp32 weights, from its first data-parallel rank
    full = {n: deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    if engine.grid.get_data_parallel_rank() == 0:
        torch.save(full, f"{out}.stage{engine.grid.get_stage_id()}.pt")
    torch.distributed.barrier()
"""

PIPE_TRAIN = PIPE_BUILD + """
half, out, stages, steps, zero, more = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
model, opt = build(stages, 0)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(half, zero))
for s in range(steps):
    step(engine, s, half)
engine.save_checkpoint(out)
if len(sys.argv) > 7 and sys.argv[7] == "state":  # what DeepSpeed says each param's state is, as saved
    full = {}
    for n, p in model.named_parameters():
        full[n + ".param"] = deepspeed.utils.safe_get_full_fp32_param(p).clone()
        for k in ("exp_avg", "exp_avg_sq"):
            full[f"{n}.{k}"] = deepspeed.utils.safe_get_full_optimizer_state(p, k).clone()
    if engine.grid.get_data_parallel_rank() == 0:
        torch.save(full, f"{out}.state{engine.grid.get_stage_id()}.pt")
    torch.distributed.barrier()
for s in range(steps, steps + more):  # the run continues: each stage's fp32 weights at the end
    step(engine, s, half)
if more:
    dump(engine, model, out + ".continued")
"""

# A universal checkpoint loaded into a fresh pipeline of `stages` stages (its own init), two more steps.
PIPE_RESUME = PIPE_BUILD + """
load_dir, tag, out, stages = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model, opt = build(stages, 1)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config("fp32", 1, universal=True))
engine.load_checkpoint(load_dir, tag=tag)
assert engine.global_steps == 3
for s in range(3, 5):
    step(engine, s, "fp32")
dump(engine, model, out)
"""


def stage_weights(out, stages):
    full = {}
    for s in range(stages):
        full.update(torch.load(f"{out}.stage{s}.pt"))
    return full


PIPE_NAMES = ["tied_modules.embed.weight", "1.weight", "3.weight", "5.weight", "1.bias", "3.bias", "4.weight",
              "4.bias", "5.bias"]


def pipe_run(tmp_path, half, stages, ranks, zero=1, more=0, state=False):
    out = tmp_path / f"pipe{stages}_{half}_{ranks}_zero{zero}"
    run_script(tmp_path, PIPE_TRAIN, "pipe_train.py", half, out, stages, 3, zero, more, "state" if state else "-",
               ranks=ranks)
    return out


@pytest.mark.parametrize("half,stages,ranks", [("fp32", 2, 4), ("bf16", 2, 4), ("fp16", 3, 3)])
def test_pipeline_checkpoint_reads_as_deepspeeds_own_reassembly(tmp_path, optstate_cli, half, stages, ranks):
    """A PipelineModule's checkpoint (GPT-NeoX's and Megatron-DeepSpeed's engine, without tensor
    parallelism): each stage's ZeRO-1 files are its model-parallel rank's. optstate reads them as one
    state, bit for bit what DeepSpeed's ds_to_universal reassembles (which optstate reads as the same
    state), the tied embedding once (validate compares its copies)."""
    ck = pipe_run(tmp_path, half, stages, ranks)
    tag = ck / "global_step3"
    assert len(list(tag.glob("*mp_rank_*_optim_states.pt"))) == ranks
    out = optstate_cli("convert", ck, tmp_path / "plain.pt")
    assert "layer_*-model_states.pt (6 files" in out.stderr, out.stderr
    assert f"'tied_modules.embed.weight' is held by pipeline stages 0 and {stages - 1}" in out.stderr, out.stderr
    assert sorted(plain_is_ds_to_universal(tmp_path, optstate_cli, ck)) == sorted(PIPE_NAMES)
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout


def test_pipeline_universal_checkpoint_is_ds_to_universals_and_deepspeed_resumes_it_on_other_grids(
        tmp_path, optstate_cli):
    """`convert --format deepspeed` of a pipeline's checkpoint (2 stages on 4 ranks) writes what
    ds_to_universal writes: every stage's model states file as it was, one zero/<param>/ of each
    param (the tied module's once), stage 0's settings. DeepSpeed's pipeline (which takes the
    weights from zero/ under "load_universal", not from the layer files) resumes from it on 2 stages
    of 1 rank and on 3 stages, to the uninterrupted run's fp32 weights bit for bit, as from
    ds_to_universal's own."""
    ck = pipe_run(tmp_path, "fp32", 2, 4, more=2)
    ref = universal(tmp_path, ck, "global_step3")
    ours = tmp_path / "ours_universal"
    out = optstate_cli("convert", ck, ours, "--format", "deepspeed")
    assert "layer_*-model_states.pt (6 files" in out.stderr and "not in" in out.stderr, out.stderr
    assert hashes(optstate_cli, ours) == hashes(optstate_cli, ck) == hashes(optstate_cli, ref)
    assert sorted(same_param_files(ref, ours)) == sorted(PIPE_NAMES)
    for s in (0, 1):
        name = f"mp_rank_{s:02d}_model_states.pt"
        assert (ours / name).read_bytes() == (ref / name).read_bytes()
    a = torch.load(ref / "zero" / "optimizer_state.pt", weights_only=False)
    b = torch.load(ours / "zero" / "optimizer_state.pt", weights_only=False)
    assert list(a) == list(b) and a["param_groups"] == b["param_groups"]
    continued = stage_weights(str(ck) + ".continued", 2)
    for stages, tag in ((2, ours.name), (3, ours.name), (2, ref.name)):
        res = tmp_path / f"resumed_{stages}_{tag}"
        run_script(tmp_path, PIPE_RESUME, "pipe_resume.py", tmp_path, tag, res, stages, ranks=stages)
        got = stage_weights(res, stages)
        assert sorted(got) == sorted(continued)
        assert all(torch.equal(got[n], continued[n]) for n in got), (stages, tag)


def test_pipeline_tied_copies_that_differ_are_a_validate_finding(tmp_path, optstate_cli):
    """The tied module's copy in the last stage is stepped alike (DeepSpeed sums the tie's gradients);
    stage 0's is read. A copy that differs (files of two runs, a damaged resave) is named by validate,
    with its stage and element; other damage to the stages' agreement is refused on open."""
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(SEEDS / "pipe2_zero1_world4", ck)
    f = ck / "global_step3" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    sd = torch.load(f, weights_only=False)
    osd = sd["optimizer_state_dict"]
    a = osd["param_slice_mappings"][0]["tied_modules.embed.weight"]
    osd["base_optimizer_state"]["state"][0]["exp_avg"][a.start + 5] += 1e-3
    torch.save(sd, f)
    optstate_cli("inspect", ck)  # reads: stage 0's copy
    proc = optstate_cli("validate", ck, check=False)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "'tied_modules.embed.weight' exp_avg: pipeline stage 1's copy differs from the copy read at element 5" \
        in proc.stdout, proc.stdout
    # stage 1's step other than stage 0's (its files from another iteration): refused
    shutil.rmtree(ck)
    shutil.copytree(SEEDS / "pipe2_zero1_world4", ck)
    for rank in (0, 1):
        f = ck / "global_step3" / f"zero_pp_rank_{rank}_mp_rank_01_optim_states.pt"
        sd = torch.load(f, weights_only=False)
        for st in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            st["step"] += 1
        torch.save(sd, f)
    err = run_err(optstate_cli, "inspect", ck)
    assert "step 4, its copy in stage 0 step 3" in err or "an earlier pipeline stage step 3" in err, err


def test_pipeline_under_bf16_without_zero_reads_its_shapes_from_the_layer_files(tmp_path, optstate_cli):
    """A pipeline under bf16 without ZeRO (Megatron-DeepSpeed's default under bf16): DeepSpeed's
    BF16_Optimizer saves bf16_zero_pp_rank_* files, each rank's flat partitions with its params'
    runs named (param_slice_mappings), but the model states hold no param_shapes (DeepSpeed 0.19.8's
    own ds_to_universal fails on them). The shapes are the layer files' tensors ('<L>.<key>' in
    layer_<L>-model_states.pt; the tied embedding by its name and size): what optstate reads is what
    DeepSpeed's safe_get_full_fp32_param / safe_get_full_optimizer_state gave for every param at
    the save, bit for bit. A layer file gone, or two candidates for the tied module of different
    shapes, is refused by name."""
    ck = pipe_run(tmp_path, "bf16", 2, 4, zero=0, state=True)
    tag = ck / "global_step3"
    assert len(list(tag.glob("bf16_zero_pp_rank_*"))) == 4
    raw = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    assert raw["param_shapes"] is None and raw["module"] is None
    info = optstate_cli("inspect", ck).stdout
    assert "9 params" in info and "shape read from the pipeline's layer files" in info, info
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    optstate_cli("convert", ck, tmp_path / "plain.safetensors")
    from safetensors.torch import load_file
    got = load_file(tmp_path / "plain.safetensors")
    want = {}
    for stage in (0, 1):
        want.update(torch.load(f"{ck}.state{stage}.pt"))
    assert {k.rsplit(".", 1)[0] for k in want} == set(PIPE_NAMES)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # a layer file gone: named
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tag, bad)
    (bad / "layer_03-model_states.pt").unlink()
    err = run_err(optstate_cli, "inspect", bad)
    assert "'3.weight' (param_shapes is None): no layer_03-model_states.pt in" in err or \
        "'3.bias' (param_shapes is None): no layer_03-model_states.pt in" in err, err
    # another layer holding a 'weight' of the embedding's 2560 elements in another shape: ambiguous
    shutil.rmtree(bad)
    shutil.copytree(tag, bad)
    torch.save({"weight": torch.zeros(64, 40, dtype=torch.bfloat16)}, bad / "layer_02-model_states.pt")
    err = run_err(optstate_cli, "inspect", bad)
    assert "layer_00-model_states.pt and layer_02-model_states.pt hold a 'weight' of its 2560 elements, shaped " \
           "[40, 64] and [64, 40]" in err or "layer_02-model_states.pt and layer_00-model_states.pt" in err, err
    # DeepSpeed 0.19.8 resumes neither its own checkpoint of this setup nor a universal one (its
    # stage-0 load gives BF16_Optimizer one dict for a list per rank: KeyError, measured): no
    # universal checkpoint is written from it
    err = run_err(optstate_cli, "convert", ck, tmp_path / "u", "--format", "deepspeed")
    assert "DeepSpeed loads no universal checkpoint into it" in err and not (tmp_path / "u").exists(), err


def test_pipeline_without_zero_in_fp32_is_refused_naming_why(tmp_path, optstate_cli):
    """fp32 (or fp16) without ZeRO: each stage's optimizer inside its model states file, its params
    numbered, no file saying which layers a stage holds: refused, naming the bf16 form that is read."""
    ck = pipe_run(tmp_path, "fp32", 2, 2, zero=0)
    assert not list((ck / "global_step3").glob("*optim_states.pt"))
    err = run_err(optstate_cli, "inspect", ck)
    assert "a DeepSpeed pipeline without ZeRO in fp32 or fp16 (its layer files, layer_00-model_states.pt" in err, err
    assert "under bf16 (its BF16_Optimizer's bf16_zero_pp_rank_* files) it is" in err, err


# DeepSpeed's AutoTP (tensor_parallel.autotp_size; its partition_config's layer specs): a LLaMA-like
# model whose q/k/v are split by rows, o_proj and down_proj by columns, gate_up_proj's two halves each
# by rows, the rest replicated; ZeRO-1 over the data-parallel ranks; every rank the same batch.
TP_BUILD = f"""
import sys, torch, deepspeed
sys.path.insert(0, {str(SEEDS)!r})
from make_seeds import AUTOTP_SPECS, llama_like
deepspeed.init_distributed(dist_backend="gloo")
""" + """
def engine_of(tp, seed, universal=False, zero=1):
    torch.manual_seed(seed)
    model = llama_like(32, 48, 64, 2, 5.0)
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-3}]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": zero}, "checkpoint": {"load_universal": universal},
           "tensor_parallel": {"autotp_size": tp, "partition_config": {"use_default_specs": False,
                                                                       "layer_specs": AUTOTP_SPECS}}}
    return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3), config=cfg)[0], model
def step(engine, s):
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(s))
    engine.backward(torch.nn.functional.cross_entropy(engine(ids).float().flatten(0, 1), ids.flatten()))
    engine.step()
def dump(model, out, tp):  # each tensor-parallel rank's fp32 shards, from its first data-parallel rank
    shards = {n: deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    if torch.distributed.get_rank() < tp:
        torch.save(shards, f"{out}.tp{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()
"""

TP_TRAIN = TP_BUILD + """
out, tp, zero = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1
engine, model = engine_of(tp, 0, zero=zero)
for s in range(3):
    step(engine, s)
engine.save_checkpoint(out)
for s in range(3, 5):
    step(engine, s)
dump(model, out + ".continued", tp)
"""

TP_RESUME = TP_BUILD + """
load_dir, tag, out, tp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
engine, model = engine_of(tp, 1, universal=True)
engine.load_checkpoint(load_dir, tag=tag)
assert engine.global_steps == 3
for s in range(3, 5):
    step(engine, s)
dump(model, out, tp)
"""


def autotp_reads_as_ds_to_universal(tmp_path, optstate_cli, ck):
    """Asserts that optstate reads the AutoTP checkpoint `ck` (2 tensor-parallel ranks) as DeepSpeed's
    ds_to_universal reassembles it, tensor for tensor, and its output as the same state; returns the
    universal checkpoint and the param names."""
    from safetensors.torch import load_file
    out = optstate_cli("convert", ck, tmp_path / f"{ck.name}.safetensors")
    assert "2 tensor-parallel ranks (DeepSpeed's AutoTP)" in out.stderr, out.stderr
    got = load_file(tmp_path / f"{ck.name}.safetensors")
    ref = universal(tmp_path, ck, "global_step3")
    names = sorted(p.name for p in (ref / "zero").iterdir() if p.is_dir())
    assert len(names) == 24 and len(got) == 72
    for n in names:
        for f, k in (("fp32", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            assert torch.equal(got[f"{n}.{k}"], universal_tensor(ref / "zero" / n / f"{f}.pt")), (n, f)
    assert got["layers.0.gate_up_proj.weight.param"].shape == (96, 32)
    assert hashes(optstate_cli, ref) == hashes(optstate_cli, ck)
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    return ref, names


def test_autotp_checkpoint_reads_as_ds_to_universal_and_deepspeed_resumes_its_universal_checkpoint(tmp_path, optstate_cli):
    """DeepSpeed's AutoTP on 4 ranks (2 tensor-parallel x 2 data-parallel, ZeRO-1): each tensor-parallel
    rank's files hold its shards, the model states the affine maps of where they lie. optstate puts
    each param together, bit for bit what ds_to_universal reassembles (which reads as the same state);
    `convert --format deepspeed` writes ds_to_universal's files, from which DeepSpeed resumes on 2 ranks
    (2 x 1) to the uninterrupted run's shards bit for bit, and on 4 tensor-parallel ranks as from
    ds_to_universal's own."""
    ck = tmp_path / "autotp"
    run_script(tmp_path, TP_TRAIN, "tp_train.py", ck, 2, ranks=4)
    assert len(list((ck / "global_step3").glob("zero_pp_rank_*_mp_rank_0[01]_optim_states.pt"))) == 4
    ref, names = autotp_reads_as_ds_to_universal(tmp_path, optstate_cli, ck)
    ours = tmp_path / "ours_universal"
    optstate_cli("convert", ck, ours, "--format", "deepspeed")
    assert sorted(same_param_files(ref, ours)) == names
    for t in (0, 1):
        name = f"mp_rank_{t:02d}_model_states.pt"
        assert (ours / name).read_bytes() == (ref / name).read_bytes()
    continued = [torch.load(f"{ck}.continued.tp{t}.pt") for t in (0, 1)]
    res = tmp_path / "resumed2"
    run_script(tmp_path, TP_RESUME, "tp_resume.py", tmp_path, ours.name, res, 2, ranks=2)
    for t in (0, 1):
        shards = torch.load(f"{res}.tp{t}.pt")
        assert all(torch.equal(shards[n], continued[t][n]) for n in shards), t
    for tag in (ours.name, ref.name):
        run_script(tmp_path, TP_RESUME, "tp_resume.py", tmp_path, tag, tmp_path / f"tp4_{tag}", 4, ranks=4)
    for t in range(4):
        a, b = (torch.load(tmp_path / f"tp4_{tag}.tp{t}.pt") for tag in (ours.name, ref.name))
        assert a["layers.1.q_proj.weight"].shape == (8, 32) and all(torch.equal(a[n], b[n]) for n in a), t


def test_autotp_damaged_maps_and_differing_replicas_are_named(tmp_path, optstate_cli):
    """The affine maps are checked: blocks that overlap or leave a hole (in the whole tensor or a
    rank's shard), a pattern that names no one
    param, a scaled piece (DeepSpeed refuses converting its moments too), no maps at all. A replicated
    param's copy on rank 1 that differs from rank 0's is validate's finding."""
    import shutil
    seed = SEEDS / "autotp2_zero1_world2"

    def damaged(name, edit, file="mp_rank_00_model_states.pt"):
        ck = tmp_path / name
        shutil.copytree(seed, ck)
        f = ck / "global_step3" / file
        sd = torch.load(f, weights_only=False)
        edit(sd)
        torch.save(sd, f)
        return ck

    def maps(sd):
        return sd["universal_checkpoint_info"]["affine_map"]["params"]

    def overlap(sd):
        maps(sd)[r"^layers\.0\.q_proj\.weight$"]["ranks"][1]["pieces"][0]["source"][0] = 0
    err = run_err(optstate_cli, "inspect", damaged("overlap", overlap))
    assert "'layers.0.q_proj.weight': the affine map's pieces cover twice element 0" in err, err

    def shard_twice(sd):  # gate_up_proj's second half read from the shard's first half again
        maps(sd)[r"^layers\.0\.gate_up_proj\.weight$"]["ranks"][0]["pieces"][1]["dest"][0] = 0
    err = run_err(optstate_cli, "inspect", damaged("shard_twice", shard_twice))
    assert "'layers.0.gate_up_proj.weight' (tensor-parallel rank 0): the affine map's pieces read twice element 0 " \
           "of its shard" in err, err

    def pattern(sd):
        m = maps(sd)
        m[r"^layers\.\d+\.q_proj\.weight$"] = m.pop(r"^layers\.0\.q_proj\.weight$")
    err = run_err(optstate_cli, "inspect", damaged("pattern", pattern))
    assert "names no one param" in err, err

    def scaled(sd):
        for rank in maps(sd)[r"^norm\.weight$"]["ranks"].values():
            rank["pieces"][0]["scale"] = 0.5
    err = run_err(optstate_cli, "inspect", damaged("scaled", scaled))
    assert "a piece held times 0.5" in err and "DeepSpeed itself refuses" in err, err

    def no_maps(sd):
        del sd["universal_checkpoint_info"]["affine_map"]
    err = run_err(optstate_cli, "inspect", damaged("no_maps", no_maps))
    assert "no affine_map in universal_checkpoint_info (its name patterns, Megatron-DeepSpeed's or AutoTP's" in err, err

    def replica(sd):
        osd = sd["optimizer_state_dict"]
        a = osd["param_slice_mappings"][1]["norm.weight"]
        osd["base_optimizer_state"]["state"][1]["exp_avg"][a.start + 3] += 1e-3
    ck = damaged("replica", replica, "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    optstate_cli("inspect", ck)  # reads: rank 0's copy
    proc = optstate_cli("validate", ck, check=False)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "'norm.weight' exp_avg: tensor-parallel rank 1's copy differs from the copy read at element 3" in proc.stdout, \
        proc.stdout


def test_autotp_under_zero3_reads_as_ds_to_universal(tmp_path, optstate_cli):
    """AutoTP under ZeRO-3 (2 x 2 ranks): each tensor-parallel rank's shards split again over its
    data-parallel ranks, a model states file per rank (zero_pp_rank_D_mp_rank_TT_model_states.pt).
    Read bit for bit as ds_to_universal reassembles it; written for another world size it is refused
    by name (the ZeRO-3 writer lays out a checkpoint without tensor parallelism)."""
    ck = tmp_path / "autotp_zero3"
    run_script(tmp_path, TP_TRAIN, "tp_train.py", ck, 2, 3, ranks=4)
    assert len(list((ck / "global_step3").glob("zero_pp_rank_*_mp_rank_0[01]_model_states.pt"))) == 4
    autotp_reads_as_ds_to_universal(tmp_path, optstate_cli, ck)
    err = run_err(optstate_cli, "convert", ck, tmp_path / "w4", "--format", "deepspeed", "--world-size", "4")
    assert "a ZeRO-3 checkpoint of 2 tensor-parallel ranks (AutoTP)" in err and not (tmp_path / "w4").exists(), err


# DeepSpeed's MoE layers (deepspeed.moe.layer.MoE) under expert parallelism on 4 ranks: one of 4
# two-layer experts over ep_size 2 (2 experts a rank, each split over 2 expert-data-parallel ranks),
# one of 8 linear experts over ep_size 4 (2 a rank, 1 expert-data-parallel rank), ZeRO-1/2, the
# param groups split as DeepSpeed requires (split_params_into_different_moe_groups_for_optimizer).
# "de": use_data_before_expert_parallelism (expert-parallel groups of ranks 2 apart, not consecutive).
# After the save each rank dumps what DeepSpeed holds of its params (safe_get_full_fp32_param /
# safe_get_full_optimizer_state), experts under their global numbers.
MOE_TRAIN = """
import sys, re, torch, deepspeed
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state
out, stage, half, layout, fused = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "fused"
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 24)
        expert = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 24))
        self.moe1 = MoE(hidden_size=24, expert=expert, num_experts=4, ep_size=2, k=1)
        # (DeepSpeed 0.19.8's FP16_Optimizer hangs on this CPU build with MoE layers of two sizes)
        self.moe2 = MoE(hidden_size=24, expert=torch.nn.Linear(24, 24), num_experts=8, ep_size=2 if fused else 4, k=2)
        self.out = torch.nn.Linear(24, 3)
    def forward(self, x):
        return self.out(self.moe2(self.moe1(self.inp(x))[0])[0])
model = Model()
groups_ = split_params_into_different_moe_groups_for_optimizer(
    [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05, "name": "w"},
     {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-3, "name": "b"}])
# DeepSpeed orders each client group's MoE groups by a set of their names (ep_size_2, ep_size_4), so
# ranks with other hash seeds (torchrun's processes) hold them in other orders; here each pair put in
# name order on every rank (whatever this process's hash seed), then the odd ranks' swapped.
if len(groups_) == 6:
    pairs = [sorted(groups_[i:i + 2], key=lambda g: g["name"]) for i in (2, 4)]
    if torch.distributed.get_rank() % 2:
        pairs = [pair[::-1] for pair in pairs]
    groups_ = groups_[:2] + pairs[0] + pairs[1]
cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage}, "bf16": {"enabled": half == "bf16"},
       "fp16": {"enabled": half == "fp16", "initial_scale_power": 8}, "use_data_before_expert_parallelism": layout == "de"}
if fused:  # DeepSpeed's AdamW from the config (FusedAdam): under bf16/fp16 FP16_Optimizer, each group flat
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    if half == "fp16":  # DeepSpeed's CPU accelerator claims fp16 only with oneDNN's fp16 kernels; torch's run anywhere
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
    engine = deepspeed.initialize(model=model, model_parameters=groups_, config=cfg)[0]
    assert type(engine.optimizer).__name__ == "FP16_Optimizer", type(engine.optimizer)
else:
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups_, lr=1e-3), config=cfg)[0]
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(half, torch.float32)
for s in range(3):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * s + torch.distributed.get_rank()))
    engine.backward(engine(x.to(dtype)).float().square().sum())
    engine.step()
engine.save_checkpoint(out)
local = {n: m.num_local_experts for n, m in model.named_modules() if isinstance(m, MoE)}
opt = engine.optimizer
if stage > 0:
    # DeepSpeed links its params to their optimizer state after the first group's first step only
    # (it steps group by group), so the later groups' state is not found by
    # safe_get_full_optimizer_state until linked again.
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()
    held = lambda p: (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                      safe_get_full_optimizer_state(p, "exp_avg_sq"))
elif fused:  # FP16_Optimizer: each group's params are runs of its flat master and moments, in order
    runs = {}
    for ps, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
        st, at = opt.optimizer.state[flat], 0
        for p in ps:
            runs[id(p)] = tuple(t[at:at + p.numel()].view(p.shape) for t in (flat, st["exp_avg"], st["exp_avg_sq"]))
            at += p.numel()
        assert at == flat.numel()
    held = lambda p: runs[id(p)]
elif half == "fp32":  # without ZeRO: the client optimizer steps the params themselves
    held = lambda p: (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
else:  # ... or, under bf16, their fp32 masters (the wrapper's fp32_groups)
    master = {id(p): q for g16, g32 in zip(opt.fp16_groups, opt.fp32_groups) for p, q in zip(g16, g32)}
    held = lambda p: (master[id(p)], opt.optimizer.state[master[id(p)]]["exp_avg"],
                      opt.optimizer.state[master[id(p)]]["exp_avg_sq"])
ref = {}
for n, p in model.named_parameters():
    m = re.match(r"(.*)\\.deepspeed_moe\\.experts\\.deepspeed_experts\\.(\\d+)(\\..*)", n)
    if m:
        e = groups._get_expert_parallel_rank(p.group_name)
        n = f"{m[1]}.deepspeed_moe.experts.deepspeed_experts.{e * local[m[1]] + int(m[2])}{m[3]}"
    ref[n] = {k: v.clone() for k, v in zip(("param", "exp_avg", "exp_avg_sq"), held(p))}
torch.save(ref, f"{out}.ref{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
"""


def moe_run(tmp_path, stage, half, layout, fused=False):
    ck = tmp_path / f"moe_zero{stage}_{half}_{layout}{'_fused' if fused else ''}"
    run_script(tmp_path, MOE_TRAIN, "moe_train.py", ck, stage, half, layout, "fused" if fused else "client", ranks=4)
    ref = {}
    for r in range(4):  # each rank's: the dense params and its experts (an expert's copies agree)
        for n, entries in torch.load(f"{ck}.ref{r}.pt").items():
            if n in ref:
                assert all(torch.equal(ref[n][k], entries[k]) for k in entries), (n, r)
            ref[n] = entries
    return ck, ref


def assert_moe_state(path, ref, step):
    """The torch.save file optstate wrote (`path`) holds every param of `ref` (moe_run's), each one's
    fp32 weights and moments equal bit for bit, its step `step`; its groups, as a list."""
    sd = torch.load(path)
    groups = sd["optimizer"]["param_groups"]
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(ref) and len(names) == 4 + 4 * 4 + 8 * 2 + 2  # inp, out, 2 gates, the experts
    for i, n in enumerate(names):
        st = sd["optimizer"]["state"][i]
        assert st["step"].item() == step, n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], ref[n][k].view_as(st[k])), (n, k)
        assert torch.equal(sd["model"][n], ref[n]["param"].view_as(sd["model"][n])), n
    return groups


@pytest.mark.parametrize("stage,half,layout", [(1, "fp32", "ed"), (1, "bf16", "de"), (2, "bf16", "ed")])
def test_mixture_of_experts_checkpoint_reads_as_deepspeed_holds_it(tmp_path, optstate_cli, stage, half, layout):
    """DeepSpeed MoE (which its zero_to_fp32 and ds_to_universal do not convert): every expert-
    parallel rank's ZeRO partitions hold its own experts under local names (deepspeed_experts.0, .1);
    optstate reads each from its expert-data-parallel ranks under the global number DeepSpeed gives
    its layer_L_expert_E files, and the state is, bit for bit, what DeepSpeed's engine held of every
    param (fp32 weights, exp_avg, exp_avg_sq) when it saved. The ranks' files list the MoE groups in
    different orders (as ranks with other hash seeds save them): matched to rank 0's."""
    ck, ref = moe_run(tmp_path, stage, half, layout)
    prefix = "bf16_" if half == "bf16" else ""
    order = [[(g["name"], g["weight_decay"]) for g in torch.load(
        ck / "global_step3" / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]] for r in (0, 1)]
    assert order[1] == order[0][:2] + [order[0][3], order[0][2], order[0][5], order[0][4]] != order[0]
    done = optstate_cli("convert", ck, tmp_path / "plain.pt")
    assert "layer_*_expert_*_model_states.pt (12 files" in done.stderr, done.stderr
    assert "DeepSpeed MoE: 2 MoE layers' experts read under their global numbers" in done.stderr, done.stderr
    # each client group and its MoE twin ("w", "ep_size_2_w", ...)
    for g in assert_moe_state(tmp_path / "plain.pt", ref, 3):
        assert g["weight_decay"] == (0.05 if g["param_names"][0].endswith("weight") else 0.0)
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    err = run_err(optstate_cli, "convert", ck, tmp_path / "u", "--format", "deepspeed")
    assert "DeepSpeed MoE layers' experts, which DeepSpeed does not load from a universal" in err
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("half,layout", [("fp32", "ed"), ("bf16", "de")])
def test_mixture_of_experts_without_zero_reads_as_deepspeed_holds_it(tmp_path, optstate_cli, half, layout):
    """DeepSpeed MoE without ZeRO (stage 0): each expert-parallel rank of the largest group (4)
    saves its whole optimizer, numbered, in expp_rank_E_mp_rank_00_optim_states.pt; no file names
    the numbers, nor which MoE layer has which expert-parallel size. optstate places each group's
    params by order and shape among ['module'] (dense) and the rank's experts (layer_L_expert_G
    files), finds the layers' sizes (2 and 4) as the one assignment that fits, and the state is, bit
    for bit, what each rank's engine held (fp32: the params and torch's AdamW state; bf16: the
    wrapper's fp32 masters and their state, a step ahead as for FP16_UnfusedOptimizer)."""
    ck, ref = moe_run(tmp_path, 0, half, layout)
    tag = ck / "global_step3"
    assert sorted(p.name for p in tag.glob("expp_rank_*")) == [f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in range(4)]
    done = optstate_cli("convert", ck, tmp_path / "plain.pt")
    assert "DeepSpeed MoE without ZeRO" in done.stderr and "expert-parallel sizes [2, 4]" in done.stderr, done.stderr
    assert "16 params of experts an earlier file holds too" in done.stderr, done.stderr
    for g in assert_moe_state(tmp_path / "plain.pt", ref, 3 if half == "fp32" else 4):
        assert (g["weight_decay"], g["lr"]) == ((0.05, 1e-3) if g["param_names"][0].endswith("weight") else (0.0, 2e-3))
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    err = run_err(optstate_cli, "convert", ck, tmp_path / "u", "--format", "deepspeed")
    assert "DeepSpeed MoE without ZeRO" in err and "convert it to another format" in err and not (tmp_path / "u").exists()
    # damaged: a rank's file gone, an expert's file gone, a layer's experts miscounted
    import shutil

    def damaged(name, edit):
        bad = tmp_path / name
        shutil.copytree(tag, bad)
        edit(bad)
        return run_err(optstate_cli, "inspect", bad)
    err = damaged("rank", lambda bad: (bad / "expp_rank_3_mp_rank_00_optim_states.pt").unlink())
    assert "3 expp_rank_* files, and the largest expert-parallel group has 4 ranks (ep_size_4)" in err, err
    err = damaged("expert", lambda bad: (bad / "layer_1_expert_5_mp_rank_00_model_states.pt").unlink())
    assert "no layer_1_expert_5_mp_rank_00_model_states.pt (MoE layer 1 of 8 experts" in err, err

    def count(bad):
        m = torch.load(bad / "mp_rank_00_model_states.pt", weights_only=False)
        m["num_experts"] = [4, 4]
        torch.save(m, bad / "mp_rank_00_model_states.pt")
    err = damaged("count", count)
    assert "layer_1_expert_7_mp_rank_00_model_states.pt, past the 2 MoE layers' experts" in err, err


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_mixture_of_experts_without_zero_under_fp16_optimizer_reads_its_flat_groups(tmp_path, optstate_cli, half):
    """DeepSpeed MoE without ZeRO, bf16 or fp16, DeepSpeed's FusedAdam: FP16_Optimizer keeps each group (the
    experts' too) one flat fp32 master, its optimizer one flat param a group, and nothing says which
    params a group holds or where. optstate places each rank's dense groups among ['module']'s
    bf16 weights and its expert groups among its experts' files' weights, where the master rounds
    to them, and every param's master and moments are, bit for bit, the flat tensors' runs the
    engine held at them."""
    ck, ref = moe_run(tmp_path, 0, half, "ed", fused=True)
    done = optstate_cli("convert", ck, tmp_path / "plain.pt")
    assert "FP16_Optimizer's flat groups: each param placed" in done.stderr, done.stderr
    assert_moe_state(tmp_path / "plain.pt", ref, 4)  # FP16_Optimizer's first zero-gradient step counts
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    # an expert's weights of another step: its master no longer rounds to them, so no placement fits
    tag = ck / "global_step3"
    f = tag / "layer_1_expert_5_mp_rank_00_model_states.pt"
    w = torch.load(f)
    key = next(k for k in w if k.endswith("weight"))
    w[key] = w[key] + 0.5
    torch.save(w, f)
    err = run_err(optstate_cli, "inspect", ck)
    assert "expp_rank_1_mp_rank_00_optim_states.pt: its groups of ep_size_2 placed among its experts" in err, err


def test_mixture_of_experts_files_missing_or_miscounted_are_named(tmp_path, optstate_cli):
    """An expert's weight file missing, num_experts that the groups' experts do not add up to, the
    other rank layout claimed, an expert group whose partition_count is not the world over its
    expert-parallel size: each named."""
    import shutil
    ck, _ = moe_run(tmp_path, 1, "fp32", "ed")
    tag = ck / "global_step3"

    def damaged(name, edit):
        bad = tmp_path / name
        shutil.copytree(tag, bad)
        edit(bad)
        return run_err(optstate_cli, "inspect", bad)

    def edit_file(file, change):
        def edit(bad):
            sd = torch.load(bad / file, weights_only=False)
            change(sd)
            torch.save(sd, bad / file)
        return edit

    err = damaged("gone", lambda bad: (bad / "layer_1_expert_5_mp_rank_00_model_states.pt").unlink())
    assert "no layer_1_expert_5_mp_rank_00_model_states.pt (MoE layer 1 of 8 experts" in err, err
    err = damaged("count", edit_file("mp_rank_00_model_states.pt", lambda sd: sd.update(num_experts=[4, 16])))
    assert "num_experts [4, 16] by MoE layer, but the groups of experts hold layers of [4, 8]" in err, err

    # the other rank layout claimed: expert-parallel rank 0 would be ranks 0 and 1, each holding the
    # first half of its experts' partitions
    err = damaged("layout", edit_file("mp_rank_00_model_states.pt",
                                      lambda sd: sd["ds_config"].update(use_data_before_expert_parallelism=True)))
    assert "(expert-parallel rank 0: ranks 0, 1, as ds_config's use_data_before_expert_parallelism true" in err, err

    def partitions(sd):  # an ep_size_2 group's (DeepSpeed orders the MoE groups by a set's order)
        osd = sd["optimizer_state_dict"]
        names = [g["name"] for g in osd["base_optimizer_state"]["param_groups"]]
        osd["partition_count"][names.index("ep_size_2")] = 4
    err = damaged("parts", edit_file("zero_pp_rank_2_mp_rank_00_optim_states.pt", partitions))
    assert "partition_count 4 for experts of expert-parallel size 2 (ep_size_2) in a world of 4 ranks (expected 2)" in err, err


# DeepSpeed AutoEP (its expert parallelism for Hugging Face MoE models, 0.19+): a Mixtral-shaped model
# (a model.layers.N.mlp with a router `gate` and fused experts `gate_up_proj` [E, 2F, H], `down_proj`
# [E, H, F]) that AutoEP's "mixtral" preset finds, 2 MoE layers of 4 experts over autoep_size 2 on 4
# ranks (each expert-parallel rank's experts split over 2 expert-data-parallel ranks), DeepSpeed's
# own AdamW from the config (AutoEP replaces the experts' params, and DeepSpeed then puts them in
# groups of their own), Hugging Face's two client groups.
AUTOEP_TRAIN = f"""
import sys, torch, deepspeed
sys.path.insert(0, {str(SEEDS)!r})
from make_seeds import AUTOEP_CONFIG, mixtral_like
""" + """
out, stage, half = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = mixtral_like(16, 24, 4, 2)
groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05, "name": "w"},
          {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0, "name": "b"}]
cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}, "bf16": {"enabled": half == "bf16"},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "expert_parallel": AUTOEP_CONFIG}
engine = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)[0]
dtype = torch.bfloat16 if half == "bf16" else torch.float32
for s in range(3):
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(10 * s + torch.distributed.get_rank()))
    engine.backward(engine(x.to(dtype)).float().square().sum())
    engine.step()
engine.save_checkpoint(out)
torch.distributed.barrier()
"""


@pytest.mark.parametrize("stage,half", [(1, "fp32"), (2, "bf16")])
def test_autoep_checkpoint_reads_as_ds_to_universal(tmp_path, optstate_cli, stage, half):
    """AutoEP's experts: each expert-parallel rank's params hold its experts fused ([local experts,
    ...], under the same names on every rank), split over its expert-data-parallel ranks; optstate
    reads each whole ([experts, ...]) where the affine map DeepSpeed saves places each rank's shard,
    bit for bit what DeepSpeed's ds_to_universal consolidates (which optstate reads as the same
    state); its universal layout is not written by optstate (refused, naming it)."""
    ck = tmp_path / f"autoep_zero{stage}_{half}"
    run_script(tmp_path, AUTOEP_TRAIN, "autoep_train.py", ck, stage, half, ranks=4)
    done = optstate_cli("convert", ck, tmp_path / "plain.pt")
    assert "DeepSpeed AutoEP: 2 MoE layers' fused experts (w1, w2, w3) read whole" in done.stderr, done.stderr
    assert "layer_*_expert_*_model_states.pt (8 files" in done.stderr, done.stderr
    ref = universal(tmp_path, ck, "global_step3")
    assert hashes(optstate_cli, ref) == hashes(optstate_cli, ck)
    sd = torch.load(tmp_path / "plain.pt")
    names = [n for g in sd["optimizer"]["param_groups"] for n in g["param_names"]]
    experts = [n for n in names if ".experts.w" in n]
    assert sorted(experts) == sorted(f"model.layers.{i}.mlp.experts.w{k}" for i in range(2) for k in (1, 2, 3))
    for i, n in enumerate(names):
        st = sd["optimizer"]["state"][i]
        assert st["step"].item() == 3 == universal_tensor(ref / "zero" / n / "step.pt")
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], universal_tensor(ref / "zero" / n / f"{k}.pt")), (n, k)
        assert torch.equal(sd["model"][n], universal_tensor(ref / "zero" / n / "fp32.pt")), n
    assert sd["model"]["model.layers.0.mlp.experts.w1"].shape == (4, 24, 16)  # 2 ranks' 2 experts
    assert "every chunk checksum verified" in optstate_cli("validate", ck).stdout
    err = run_err(optstate_cli, "convert", ck, tmp_path / "u", "--format", "deepspeed")
    assert "DeepSpeed AutoEP's experts: its universal checkpoint is ds_to_universal's" in err
    assert not (tmp_path / "u").exists()


def test_autoep_maps_other_than_one_block_a_rank_are_refused(tmp_path, optstate_cli):
    """An AutoEP map that does not place expert-parallel rank e's shard whole as experts e*n.. (here
    rank 1's at rank 0's place, as a damaged or folded AutoEP+AutoTP map would) is refused, naming
    the param and rank; so is an AutoEP layer whose num_experts disagrees with its local experts, and
    runs that cover the whole tensor but not each rank's shard."""
    import shutil
    tag = tmp_path / "global_step3"
    shutil.copytree(SEEDS / "autoep_zero1_world4" / "global_step3", tag)
    model = tag / "mp_rank_00_model_states.pt"
    sd = torch.load(model, weights_only=False)
    sd["ds_autoep_layers"][0]["affine_maps"]["params"]["model.layers.0.mlp.experts.w2"]["ranks"][1]["pieces"][0][
        "source"][0] = 0
    torch.save(sd, model)
    err = run_err(optstate_cli, "inspect", tag)
    assert ("AutoEP's 'model.layers.0.mlp.experts.w2': expert-parallel rank 1's map is not its shard whole as "
            "experts 2 to 3") in err, err
    sd["ds_autoep_layers"][0]["affine_maps"]["params"]["model.layers.0.mlp.experts.w2"]["ranks"][1]["pieces"][0][
        "source"][0] = 192
    sd["ds_autoep_layers"][0]["num_experts"] = 6
    torch.save(sd, model)
    err = run_err(optstate_cli, "inspect", tag)
    assert "num_experts, num_local_experts and ep_size that do not agree" in err, err
    sd["ds_autoep_layers"][0]["num_experts"] = 4
    torch.save(sd, model)
    # expert-parallel rank 0's runs of w1 one element short, rank 1's one long: the whole is covered,
    # but each rank's shard is not its own
    for rank, change in ((0, -1), (1, 1)):
        f = tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        osd = torch.load(f, weights_only=False)
        runs = osd["optimizer_state_dict"]["param_slice_mappings"][2]
        w1, w2 = "model.layers.0.mlp.experts.w1", "model.layers.0.mlp.experts.w2"
        runs[w1].numel += change  # DeepSpeed's fragment_address, a dataclass
        runs[w2].start += change
        runs[w2].numel -= change
        torch.save(osd, f)
    err = run_err(optstate_cli, "inspect", tag)
    assert "'model.layers.0.mlp.experts.w1': expert-parallel rank 0's ranks (0, 2) hold 191 elements of its shard of 192" in err, err
