"""Reading a DeepSpeed ZeRO checkpoint's optimizer state per param: `optstate convert checkpoint-N
plain.pt` (one torch.optim.AdamW state_dict with the fp32 weights) and `optstate convert checkpoint-N
universal --format deepspeed` (DeepSpeed's universal checkpoint, the same files ds_to_universal
writes) next to DeepSpeed's own tool for it, `ds_to_universal` (per-param fp32 weights, exp_avg,
exp_avg_sq files), side by side in one run on the same checkpoint and disk, cold page cache, each a
fresh process; wall time and peak RSS of each, and the raw copy as the floor.

- The checkpoint: a Llama-shaped stack (--layers pairs of 2048x4096 / 4096x2048 Linears), one
  torch.optim.AdamW step under ZeRO-2 (--stage 3: ZeRO-3) on 2 CPU ranks (gloo), engine.save_checkpoint.
- --stage 3: optstate's way to another world size is the ZeRO-3 checkpoint for 4 ranks (`convert
  --format deepspeed --world-size 4`; DeepSpeed loads its universal one with group 0's
  hyperparameters in every group), timed beside the same ds_to_universal; it must read back as the
  source's state (optstate hash).
- --autotp: ZeRO-1 under DeepSpeed's AutoTP on the 2 ranks (tensor_parallel.autotp_size 2: the
  2048x4096 Linears split by rows, the 4096x2048 ones by columns, so each rank's shard of the latter
  is 2048 runs of 2048 elements in the whole tensor), put together by the affine maps its model states
  record; optstate's universal checkpoint beside ds_to_universal's.
- --autoep: ZeRO-1 under DeepSpeed's AutoEP on the 2 ranks (expert_parallel.autoep_size 2, its
  "mixtral" preset): --layers Mixtral-shaped MoE blocks of 8 experts (make_seeds.mixtral_like, hidden
  1024, ffn 1024: fused gate_up_proj [8, 2048, 1024], down_proj [8, 1024, 1024]), each rank's 4 experts fused in its
  experts.w1/w2/w3, put together whole ([8, ...]) by the affine maps its model states record;
  optstate's read (no universal checkpoint: DeepSpeed's for AutoEP is ds_to_universal's) beside
  ds_to_universal's consolidation.
- --stage0-fp16: fp16 without ZeRO, DeepSpeed's FusedAdam from the config, so FP16_Optimizer keeps
  each param group one flat fp32 master (fp32_groups_flat) and no param's place, which optstate finds
  from the module's fp16 weights; DeepSpeed has no tool for it (ds_to_universal takes ZeRO
  checkpoints), so the reference is what a user who knows the model writes: torch.load, the flat
  tensors cut with torch.split at the params' sizes in model.parameters() order, torch.save of the
  same torch.optim.AdamW state_dict.
- --moe-stage0: DeepSpeed MoE layers (deepspeed.moe.layer.MoE: --layers blocks of 8 two-Linear
  experts 1024 -> 2048 -> 1024 over ep_size 2, a dense Linear(1024, 1024) before each) without ZeRO
  on 2 ranks, the groups split as DeepSpeed requires: each expert-parallel rank's whole optimizer
  numbered in its expp_rank_E file, no file naming the numbers, which optstate places by order and
  shape among the module's and the rank's experts' files. DeepSpeed has no tool for it; the
  reference is what a user who knows DeepSpeed's layout writes: torch.load of every file, the dense
  numbers named after ['module']'s keys, each rank's experts' after its layer_L_expert_G files, and
  torch.save of the same torch.optim.AdamW state_dict.
- DeepSpeed: `python -m deepspeed.checkpoint.ds_to_universal` with 2 extract and 2 merge workers
  (this machine's cores).
- optstate: the CLI, no Python, no DeepSpeed.
The outputs are read back and must hold the same fp32 weights and moments per param, bit for bit
(the two universal checkpoints: every file's tensors).

    .venv/bin/python bench/bench_deepspeed.py [--layers 2] [--reps 2] [--stage 2|3 | --autotp | --autoep | --stage0-fp16 | --moe-stage0] [--dir /tmp] [--json bench/results/deepspeed.json]
"""
import os
import sys
import textwrap
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_ckpt import checkpoint_args, dir_bytes, raw_read, raw_write  # noqa: E402
from bench_dcp_convert import prepare, report, run, time_cases  # noqa: E402

warnings.filterwarnings("ignore")

MAKE = textwrap.dedent("""
    import os, subprocess, sys, warnings
    warnings.filterwarnings("ignore")
    out, layers, stage, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]  # mode 1: AutoTP, 2: AutoEP, 3: fp16 stage 0, 4: MoE stage 0
    if len(sys.argv) == 5:  # the launcher: 2 ranks under torchrun
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                        out, layers, stage, sys.argv[4], "rank"], check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        sys.exit(0)
    import torch, deepspeed
    sys.path.insert(0, BENCH)
    from bench_ckpt import make_model
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": int(stage)}}
    if mode == "2":  # AutoEP: Mixtral-shaped MoE blocks its "mixtral" preset finds (the seeds' model)
        sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "formats", "deepspeed", "testdata"))
        from make_seeds import AUTOEP_CONFIG, mixtral_like
        torch.manual_seed(0)
        model = mixtral_like(1024, 1024, 8, int(layers), std=0.02)
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        cfg["expert_parallel"] = AUTOEP_CONFIG
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[{"params": list(model.parameters()),
                                                                               "name": "all"}], config=cfg)
        engine.backward(engine(torch.randn(1, 4, 8)).square().mean())
        engine.step()
        engine.save_checkpoint(out)
        torch.distributed.barrier()
        sys.exit(0)
    if mode == "4":  # DeepSpeed MoE without ZeRO
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        torch.manual_seed(0)
        blocks = []
        for _ in range(int(layers)):
            expert = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
            blocks += [torch.nn.Linear(1024, 1024), MoE(hidden_size=1024, expert=expert, num_experts=8, ep_size=2, k=1)]
        class Stack(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = torch.nn.ModuleList(blocks)
            def forward(self, x):
                for b in self.blocks:
                    x = b(x)[0] if isinstance(b, MoE) else b(x)
                return x
        model = Stack()
        groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()), "name": "all"}])
        cfg["zero_optimization"] = {"stage": 0}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3), config=cfg)
        x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.save_checkpoint(out)
        torch.distributed.barrier()
        sys.exit(0)
    model = make_model(int(layers))
    if mode == "3":  # fp16 without ZeRO around DeepSpeed's FusedAdam: FP16_Optimizer
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True  # fp16 math runs on any CPU
        cfg.update({"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                    "fp16": {"enabled": True, "initial_scale_power": 8}})
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        assert type(engine.optimizer).__name__ == "FP16_Optimizer", type(engine.optimizer)
        engine.backward(engine(torch.randn(1, 2048).half()).float().square().mean())
        engine.step()
        engine.save_checkpoint(out)
        torch.distributed.barrier()
        sys.exit(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "1":  # even Linears (2048 -> 4096) split by rows, odd ones (4096 -> 2048) by columns
        cfg["tensor_parallel"] = {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
            {"patterns": [r"^[0-9]*[02468]\.weight$"], "partition_type": "column"},
            {"patterns": [r"^[0-9]*[13579]\.weight$"], "partition_type": "row"}]}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    engine.backward(engine(torch.randn(1, 2048)).square().mean())
    engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()
""")

UNIVERSAL = textwrap.dedent("""
    import os, subprocess, sys
    src, dst = sys.argv[1], sys.argv[2]
    tag = open(os.path.join(src, "latest")).read().strip()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(src, tag), "--output_folder", dst, "--num_extract_workers", "2",
                    "--num_merge_workers", "2", "--inject_missing_state"], check=True,
                   env=dict(os.environ, DS_ACCELERATOR="cpu"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
""")


# The reference of --stage0-fp16: the flat masters and moments cut at the params' sizes, in the order
# FP16_Optimizer flattened them (model.parameters(): the module's tensors, one group), saved as
# torch.optim.AdamW's state_dict with the fp32 weights beside it.
STAGE0_SPLIT = textwrap.dedent("""
    import os, sys, torch
    src, dst = sys.argv[1], sys.argv[2]
    tag = open(os.path.join(src, "latest")).read().strip()
    sd = torch.load(os.path.join(src, tag, "mp_rank_00_model_states.pt"), weights_only=False)
    module, wrapper = sd["module"], sd["optimizer"]
    names = list(module)
    shapes = [module[n].shape for n in names]
    numels = [module[n].numel() for n in names]
    inner = wrapper["optimizer_state_dict"]
    cut = lambda flat: [t.view(s) for t, s in zip(torch.split(flat, numels), shapes)]
    weights = cut(wrapper["fp32_groups_flat"][0])
    moments = {k: cut(inner["state"][0][k]) for k in ("exp_avg", "exp_avg_sq")}
    step = torch.tensor(float(inner["state"][0]["step"]))
    group = {k: v for k, v in inner["param_groups"][0].items() if k not in ("params", "bias_correction", "step")}
    group.update(params=list(range(len(names))), param_names=names)
    torch.save({"model": dict(zip(names, weights)),
                "optimizer": {"state": {i: {"step": step, "exp_avg": moments["exp_avg"][i],
                                            "exp_avg_sq": moments["exp_avg_sq"][i]} for i in range(len(names))},
                              "param_groups": [group]}}, dst)
""")


# The reference of --moe-stage0: each expert-parallel rank's numbered state named as DeepSpeed laid it
# out for this model (one client group split into the dense group and the experts' "ep_size_2"):
# the dense numbers ['module']'s keys in order, the experts' numbers the rank's experts' keys (local
# expert i of rank e is global expert 4e+i of each layer) in module order.
MOE_NAME = textwrap.dedent("""
    import glob, os, re, sys, torch
    src, dst = sys.argv[1], sys.argv[2]
    tag = os.path.join(src, open(os.path.join(src, "latest")).read().strip())
    module = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    layers = len(glob.glob(os.path.join(tag, "layer_*_expert_0_mp_rank_00_model_states.pt")))
    names, state, weights, group = [], {}, {}, None
    for e in range(2):
        opt = torch.load(os.path.join(tag, f"expp_rank_{e}_mp_rank_00_optim_states.pt"), weights_only=False)["optimizer"]
        experts = {}
        for l in range(layers):
            for i in range(4):
                experts.update(torch.load(os.path.join(tag, f"layer_{l}_expert_{4 * e + i}_mp_rank_00_model_states.pt")))
        for g in opt["param_groups"]:
            dense = not g.get("moe", False)
            if dense and e > 0:
                continue
            keys = list(module) if dense else list(experts)
            group = group or {k: v for k, v in g.items() if k not in ("params", "name", "moe")}
            for i, k in zip(g["params"], keys):
                names.append(k)
                state[len(names) - 1] = opt["state"][i]
                weights[k] = (module if dense else experts)[k]
    group.update(params=list(range(len(names))), param_names=names)
    torch.save({"model": weights, "optimizer": {"state": state, "param_groups": [group]}}, dst)
""")


def universal_tensor(path):
    t = torch.load(path, weights_only=False)
    return t["param"] if isinstance(t, dict) else t


def main():
    ap = checkpoint_args(layers=2, reps=2)
    ap.add_argument("--stage", type=int, choices=(2, 3), default=2)
    ap.add_argument("--autotp", action="store_true", help="ZeRO-1 under AutoTP on the 2 ranks (2 tensor-parallel ranks)")
    ap.add_argument("--autoep", action="store_true", help="ZeRO-1 under AutoEP on the 2 ranks (2 expert-parallel ranks)")
    ap.add_argument("--stage0-fp16", action="store_true", help="fp16 without ZeRO, FusedAdam (FP16_Optimizer's flat groups)")
    ap.add_argument("--moe-stage0", action="store_true", help="DeepSpeed MoE without ZeRO (expp_rank_* files)")
    args = ap.parse_args()
    if args.autotp or args.autoep:
        args.stage = 1
    by_hand = args.stage0_fp16 or args.moe_stage0  # no DeepSpeed tool: the reference a user writes
    if by_hand:
        args.stage = 0
    cli, work, env, scripts = prepare("deepspeed", args.dir, MAKE, STAGE0_SPLIT if args.stage0_fp16 else
                                      MOE_NAME if args.moe_stage0 else UNIVERSAL, needs="deepspeed")
    src = work / "ckpt"
    mode = 4 if args.moe_stage0 else 3 if args.stage0_fp16 else 2 if args.autoep else int(args.autotp)
    t_make = run([sys.executable, scripts["make.py"], src, args.layers, args.stage, mode])
    src_bytes = dir_bytes(src)
    kind = {0: f"ZeRO-{args.stage}, 2 ranks", 1: "ZeRO-1 under AutoTP, 2 tensor-parallel ranks",
            2: "ZeRO-1 under AutoEP, 2 expert-parallel ranks",
            3: "fp16 without ZeRO (FP16_Optimizer's flat groups), 2 ranks",
            4: "MoE without ZeRO (expp_rank_* files), 2 expert-parallel ranks"}[mode]
    layers = "MoE blocks of 8 experts" if args.autoep or args.moe_stage0 else "layer pairs"
    print(f"source: {src_bytes / 1e9:.2f} GB DeepSpeed {kind} checkpoint ({args.layers} {layers}, made in "
          f"{t_make:.0f} s); {os.cpu_count()} cpus, torch {torch.__version__}")
    reference = ("torch.load + torch.split" if args.stage0_fp16 else "torch.load + naming by hand" if args.moe_stage0
                 else "DeepSpeed ds_to_universal")
    ours = "optstate universal" if args.stage != 3 else "optstate ZeRO-3, 4 ranks"
    dst = {"optstate": work / "plain.pt", ours: work / "ours_deepspeed", reference: work / "universal"}
    cases = {
        "optstate": lambda out: [cli, "convert", src, out],
        ours: lambda out: [cli, "convert", src, out, "--format", "deepspeed"] + (["--world-size", 4] if args.stage == 3 else []),
        reference: lambda out: [sys.executable, scripts["convert_reference.py"], src, out],
    }
    if args.autoep or by_hand:  # AutoEP's universal checkpoint is ds_to_universal's alone; stage 0 has none
        del cases[ours], dst[ours]
    times, peak = time_cases(cases, dst, src, args.reps, env)
    dst_bytes = os.path.getsize(dst["optstate"])
    buf = bytearray(max(src_bytes, dst_bytes))
    for rep in range(args.reps):
        times["floor (raw copy)"].append(raw_copy(src, buf, work, dst_bytes))
    sd = torch.load(dst["optstate"], weights_only=True)
    names = [n for g in sd["optimizer"]["param_groups"] for n in g["param_names"]]
    if by_hand:
        theirs = torch.load(dst[reference], weights_only=True)
        their_names = [n for g in theirs["optimizer"]["param_groups"] for n in g["param_names"]]
        assert sorted(names) == sorted(their_names)
        at = {n: i for i, n in enumerate(their_names)}
        for i, n in enumerate(names):
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sd["optimizer"]["state"][i][k], theirs["optimizer"]["state"][at[n]][k]), (n, k)
            assert torch.equal(sd["model"][n], theirs["model"][n]), n
        print(f"outputs: {dst_bytes / 1e9:.2f} GB / {os.path.getsize(dst[reference]) / 1e9:.2f} GB torch.optim.AdamW "
              f"state_dicts; {len(names)} params' fp32 weights, exp_avg and exp_avg_sq equal bit for bit")
        report(args, work, times, peak, src_bytes, dst_bytes, reference=reference)
        return
    for i, n in enumerate(names):
        st, ref = sd["optimizer"]["state"][i], dst[reference] / "zero" / n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], universal_tensor(ref / f"{k}.pt").view_as(st[k])), (n, k)
        assert torch.equal(sd["model"][n], universal_tensor(ref / "fp32.pt").view_as(sd["model"][n])), n
    if args.autoep:
        what = "ds_to_universal's, the experts whole"
    elif args.stage != 3:
        mine, theirs = dst[ours] / "zero", dst[reference] / "zero"
        for n in names:
            for f in ("fp32", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(universal_tensor(mine / n / f"{f}.pt"), universal_tensor(theirs / n / f"{f}.pt")), (n, f)
        what = "both universal checkpoints"
    else:
        import subprocess
        root = [subprocess.run([str(cli), "hash", str(p)], capture_output=True, text=True, check=True).stdout.split()[-2]
                for p in (src, dst[ours])]
        assert root[0] == root[1], root
        what = f"ds_to_universal's; optstate's 4 ranks' files, {dir_bytes(dst[ours]) / 1e9:.2f} GB, hash as the source"
    print(f"outputs: {dst_bytes / 1e9:.2f} GB torch.optim.AdamW state_dict / {dir_bytes(dst[reference]) / 1e9:.2f} GB "
          f"of per-param files ({what}); {len(names)} params' fp32 weights, exp_avg and exp_avg_sq equal bit for bit")
    report(args, work, times, peak, src_bytes, dst_bytes, reference=reference)


def raw_copy(src, buf, work, dst_bytes):
    """The floor: every file of the checkpoint read (cold) and DST's bytes written."""
    seconds = 0.0
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        n = os.path.getsize(f)
        seconds += raw_read(f, memoryview(buf)[:n])
    return seconds + raw_write(work / "raw_copy", memoryview(buf)[:dst_bytes])


if __name__ == "__main__":
    main()
