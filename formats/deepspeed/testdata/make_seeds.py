"""Writes the seed checkpoints of the deepspeed driver's tests and fuzz target: real DeepSpeed ZeRO
checkpoints of a tiny model (Linear(16, 24), GELU, Linear(24, 3); two param groups as Hugging Face's
Trainer makes them: weights decayed, biases not), three AdamW steps on 2 CPU ranks (gloo), saved
with engine.save_checkpoint (global_step3/ and `latest`):

  zero2_world2/       ZeRO-2, fp32
  zero3_world2/       ZeRO-3, fp32 (the same run: it hashes like zero2_world2/)
  bf16_zero1_world2/  ZeRO-1 under bf16 (bf16_zero_pp_rank_*: fp32 master weights and moments)
  bf16_zero0_world2/  without ZeRO (stage 0) under bf16: the optimizer inside mp_rank_00_model_states.pt,
                      DeepSpeed's FP16_UnfusedOptimizer dict (torch's state_dict, the groups' fp32 masters)
  fp16_fused_zero0_world2/  without ZeRO under fp16, DeepSpeed's FusedAdam from its config: FP16_Optimizer's dict
                      (each group's params one flat fp32 master, fp32_groups_flat; FusedAdam's state of the
                      flat params), the module's fp16 weights beside it
  zero3_world2_universal/  DeepSpeed's universal checkpoint of zero3_world2/ (its ds_to_universal)
  frozen_bf16_zero1_world2/  ZeRO-1 under bf16 of Linear(16, 24) frozen, LayerNorm(24), GELU, Linear(24, 3),
                      a float buffer and an int64 one: module tensors that no param group holds
  zero3_subgroups_world2/  ZeRO-3 of the same run with sub_group_size 100: each param group split into
                      flat params ("sub-groups"; 1e9 elements by default, so every model past 1B params)
  zero3_subgroups_world2_universal/  DeepSpeed's universal checkpoint of it
  adam_l2_zero2_world2/  ZeRO-2 with DeepSpeed's own optimizer from its config: "Adam", adam_w_mode false,
                      weight_decay 0.01 (FusedAdam in L2 mode, which only ds_config tells)
  fp16_zero3_world2/  ZeRO-3 under fp16, a dynamic loss scale from 2^16 that halves on each overflow: steps
                      1 and 2 overflow and are skipped, so the optimizer has stepped once (global_steps 3)
  fp16_unstepped_zero2_world2/  ZeRO-2 under fp16 from a loss scale of 2^40: all 3 steps overflow, the
                      optimizer has never stepped and holds no state (the fp32 weights are the initial ones)
  pipe2_zero1_world4/  a PipelineModule of 2 stages on 4 ranks (2 data-parallel ranks a stage), ZeRO-1,
                      fp32: an embedding tied to the output (TiedLayerSpec: held by both stages), Linear(12, 20),
                      GELU, Linear(20, 10), LayerNorm(10), Linear(10, 12); 3 steps of 2 micro-batches. Each
                      stage's files are its model-parallel rank's (zero_pp_rank_R_mp_rank_SS_optim_states.pt,
                      mp_rank_SS_model_states.pt), each layer's weights a layer_XX-model_states.pt
  bf16_pipe2_zero0_world4/  the same pipeline under bf16 without ZeRO (Megatron-DeepSpeed's default under bf16):
                      DeepSpeed's BF16_Optimizer saves bf16_zero_pp_rank_R_mp_rank_SS files (each rank's runs named
                      by param_slice_mappings), the model states no param_shapes: the shapes are the layer files'
  autotp2_zero1_world2/  DeepSpeed's AutoTP (tensor_parallel.autotp_size 2, its partition_config's layer specs:
                      q/k/v column-parallel, o_proj and down_proj row-parallel, gate_up_proj column-parallel in two
                      sub-params) on 2 ranks, ZeRO-1, fp32: a LLaMA-like block (Embedding(32, 16), LayerNorm, q/k/v/o
                      Linear(16, 16), gate_up Linear(16, 2 x 24), down Linear(24, 16) with biases on o and down,
                      final LayerNorm, lm_head Linear(16, 32)); each rank's files its tensor-parallel rank's
                      (mp_rank_TT), the model states' universal_checkpoint_info holding the affine maps
  moe_zero1_world4/   DeepSpeed MoE (deepspeed.moe.layer.MoE) on 4 ranks, ZeRO-1, fp32: Linear(8, 12), an MoE layer
                      of 4 experts Linear(12, 12) over ep_size 2 (2 experts a rank, each split over 2
                      expert-data-parallel ranks), Linear(12, 3); the groups split as DeepSpeed requires
                      (split_params_into_different_moe_groups_for_optimizer: weights, biases, and each one's
                      experts as "ep_size_2"); each expert's weights a layer_0_expert_E_mp_rank_00_model_states.pt
  moe_zero0_world4/   the same model and run without ZeRO (stage 0): each expert-parallel rank's whole optimizer
                      (torch's AdamW state_dict, numbered: the dense params and its 2 local experts) in
                      expp_rank_E_mp_rank_00_optim_states.pt, the dense weights in mp_rank_00's ['module']
  moe_bf16_fused_zero0_world4/  the same run without ZeRO under bf16 with DeepSpeed's AdamW from the config:
                      FP16_Optimizer keeps each param group (the experts' too) one flat fp32 master, its
                      optimizer one flat param a group, in each expert-parallel rank's expp_rank_E file
  autoep_zero1_world4/  DeepSpeed AutoEP ("expert_parallel": autoep_size 2, its "mixtral" preset) on 4 ranks, ZeRO-1,
                      fp32, DeepSpeed's AdamW from the config: Linear(8, 12), LayerNorm(12), a Mixtral-shaped MoE
                      block (router Linear(12, 4), fused experts gate_up_proj [4, 16, 12], down_proj [4, 12, 8]),
                      Linear(12, 3); AutoEP's experts.w1/w2/w3 hold each expert-parallel rank's 2 experts, the
                      model states' ds_autoep_layers their affine maps
  bnb_zero2_world2/   ZeRO-2 under bf16 wrapping bitsandbytes' AdamW8bit (Hugging Face's adamw_bnb_8bit under
                      DeepSpeed), Linear(64, 128), GELU, Linear(128, 3): the weights' partitions (4288 elements
                      each) as 8-bit codes in blocks of 256 of the partition, the biases' (66) as 32-bit state

    .venv/bin/python formats/deepspeed/testdata/make_seeds.py [NAME ...]    (needs deepspeed; 1-2 min)
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def train_pipe(out, bf16=False):
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)

    class Embed(torch.nn.Module):  # x @ W.T in, W out: the tied input embedding and output head
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(12, 8) * 0.1)

        def forward(self, x):
            return x @ self.weight.t()

    layers = [TiedLayerSpec("embed", Embed, tied_weight_attr="weight"), LayerSpec(torch.nn.Linear, 12, 20),
              torch.nn.GELU(), LayerSpec(torch.nn.Linear, 20, 10), LayerSpec(torch.nn.LayerNorm, 10),
              LayerSpec(torch.nn.Linear, 10, 12),
              TiedLayerSpec("embed", Embed, forward_fn=lambda embed, x: x @ embed.weight, tied_weight_attr="weight")]
    model = PipelineModule(layers=layers, num_stages=2, partition_method="uniform",
                           loss_fn=lambda y, t: (y.float() - t).square().mean())
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    # bf16: without ZeRO, as Megatron-DeepSpeed runs it (DeepSpeed's BF16_Optimizer)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 0 if bf16 else 1}, "bf16": {"enabled": bf16}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3), config=cfg)
    dtype = torch.bfloat16 if bf16 else torch.float32
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        batch = (torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 8, generator=g))
        engine.train_batch(data_iter=iter([batch] * 2))
    engine.save_checkpoint(out)
    torch.distributed.barrier()


AUTOTP_SPECS = [{"patterns": [r".*\.o_proj\.weight$", r".*\.down_proj\.weight$"], "partition_type": "row"},
                {"patterns": [r".*\.[qkv]_proj\.weight$"], "partition_type": "column"},
                {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
                 "partition_dim": 0}]


def llama_like(hidden, ffn, vocab, layers, temperature):
    """A LLaMA-like model whose Linears AUTOTP_SPECS splits: the seed's, and tests/python/test_deepspeed.py's
    AutoTP runs (a larger one)."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = torch.nn.LayerNorm(hidden)
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(3))
            self.o_proj = torch.nn.Linear(hidden, hidden)
            self.gate_up_proj = torch.nn.Linear(hidden, 2 * ffn, bias=False)
            self.down_proj = torch.nn.Linear(ffn, hidden)

        def forward(self, x):
            y = self.input_layernorm(x)
            a = torch.softmax(self.q_proj(y) @ self.k_proj(y).transpose(-1, -2) / temperature, -1) @ self.v_proj(y)
            x = x + self.o_proj(a)
            g, u = self.gate_up_proj(x).chunk(2, -1)
            return x + self.down_proj(torch.nn.functional.silu(g) * u)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(vocab, hidden)
            self.layers = torch.nn.ModuleList([Block() for _ in range(layers)])
            self.norm = torch.nn.LayerNorm(hidden)
            self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids):
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    return Model()


def train_autotp(out):
    import deepspeed
    import torch
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = llama_like(16, 24, 32, 1, 4.0)
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 1},
           "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False,
                                                                      "layer_specs": AUTOTP_SPECS}}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3), config=cfg)
    for step in range(3):
        ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(step))
        engine.backward(torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten()))
        engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()


def train_moe(out, stage, fused=False):
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 12)
            self.moe = MoE(hidden_size=12, expert=torch.nn.Linear(12, 12), num_experts=4, ep_size=2, k=1)
            self.out = torch.nn.Linear(12, 3)

        def forward(self, x):
            return self.out(self.moe(self.inp(x))[0])

    model = Model()
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05, "name": "w"},
         {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0, "name": "b"}])
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
    if fused:  # bf16, DeepSpeed's AdamW from the config: FP16_Optimizer, each group flat
        cfg.update({"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
        assert type(engine.optimizer).__name__ == "FP16_Optimizer", type(engine.optimizer)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3), config=cfg)
    for step in range(3):  # each rank its own batch: every expert gets tokens somewhere
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + torch.distributed.get_rank()))
        engine.backward(engine(x.bfloat16() if fused else x).float().square().sum())
        engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()


def mixtral_like(hidden, ffn, experts, layers, std=0.1):
    """A Mixtral-shaped model that DeepSpeed AutoEP's "mixtral" preset finds without transformers:
    model.embed Linear(8, hidden), model.layers.N (a LayerNorm, then an mlp block with a router `gate`
    and fused experts gate_up_proj [experts, 2 ffn, hidden], down_proj [experts, hidden, ffn], which
    AutoEP replaces whole), head Linear(hidden, 3); a config naming the expert count and top 2. The
    seed's, tests/python/test_deepspeed.py's AutoEP runs and bench/bench_deepspeed.py --autoep."""
    import types
    import torch

    class Experts(torch.nn.Module):  # Hugging Face's fused layout
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * std)
            self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, ffn) * std)

    class SparseMoeBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(hidden, experts, bias=False)
            self.experts = Experts()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(hidden)
            self.mlp = SparseMoeBlock()

        def forward(self, x):
            y = self.mlp(self.norm(x))
            return x + (y[0] if isinstance(y, tuple) else y)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(model_type="custom_moe", num_local_experts=experts,
                                                num_experts_per_tok=2, hidden_size=hidden)
            self.model = torch.nn.Module()
            self.model.embed = torch.nn.Linear(8, hidden)
            self.model.layers = torch.nn.ModuleList([Layer() for _ in range(layers)])
            self.head = torch.nn.Linear(hidden, 3)

        def forward(self, x):
            x = self.model.embed(x)
            for layer in self.model.layers:
                x = layer(x)
            return self.head(x)

    return Model()


# AutoEP's config: expert parallelism over 2 ranks by the "mixtral" preset, without grouped GEMMs
# (torch._grouped_mm is CUDA's).
AUTOEP_CONFIG = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral", "use_grouped_mm": False}


def train_autoep(out):
    import deepspeed
    import torch
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = mixtral_like(12, 8, 4, 1)
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05, "name": "w"},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0, "name": "b"}]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "expert_parallel": AUTOEP_CONFIG}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    for step in range(3):
        x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(10 * step + torch.distributed.get_rank()))
        engine.backward(engine(x).square().sum())
        engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()


def train(stage, half, out, variant):
    import deepspeed
    import torch
    if variant in ("pipe", "pipe_bf16"):
        return train_pipe(out, bf16=variant == "pipe_bf16")
    if variant == "moe":
        return train_moe(out, stage, fused=half == "bf16")
    if variant == "autoep":
        return train_autoep(out)
    if variant == "autotp":
        return train_autotp(out)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    if variant == "frozen":
        model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.GELU(),
                                    torch.nn.Linear(24, 3))
        model[0].requires_grad_(False)
        model.register_buffer("scale", torch.linspace(-2, 2, 6))  # buffers: float and int64
        model.register_buffer("seen", torch.tensor([3, -5, (1 << 40) + 1]))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    in_features = 16
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trained if p.dim() > 1], "weight_decay": 0.05},
              {"params": [p for p in trained if p.dim() <= 1], "weight_decay": 0.0}]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": half == "bf16"},
           "fp16": {"enabled": half == "fp16", "initial_scale_power": 40 if variant == "unstepped" else 16,
                    "loss_scale_window": 2, "hysteresis": 1}}
    if variant == "subgroups":
        cfg["zero_optimization"]["sub_group_size"] = 100
    if variant == "bnb":  # partitions of at least 4096 elements get 8-bit state
        import bitsandbytes as bnb
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 3))
        groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05},
                  {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
        cfg["zero_allow_untested_optimizer"] = True
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(groups, lr=1e-3), config=cfg)
        in_features = 64
    elif variant == "fused":
        # DeepSpeed's FusedAdam from the config, which fp16 without ZeRO wraps in FP16_Optimizer
        # (each group flat). DeepSpeed's CPU accelerator takes fp16 only with oneDNN's fp16 kernels;
        # the engine and checkpoint are the same without them.
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
        assert type(engine.optimizer).__name__ == "FP16_Optimizer", type(engine.optimizer)
    elif variant == "adam_l2":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "adam_w_mode": False}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-3)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(half, torch.float32)
    for step in range(3):
        x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(step))  # every rank the same batch
        engine.backward(engine(x.to(dtype)).float().square().sum())
        engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()


def main():
    if "LOCAL_RANK" in os.environ:  # a rank, under torchrun
        train(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
        return
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    wanted = set(sys.argv[1:])
    for name, stage, half, variant in (("zero2_world2", 2, "fp32", "-"), ("zero3_world2", 3, "fp32", "-"),
                                       ("bf16_zero1_world2", 1, "bf16", "-"),
                                       ("bf16_zero0_world2", 0, "bf16", "-"),
                                       ("fp16_fused_zero0_world2", 0, "fp16", "fused"),
                                       ("frozen_bf16_zero1_world2", 1, "bf16", "frozen"),
                                       ("adam_l2_zero2_world2", 2, "fp32", "adam_l2"),
                                       ("zero3_subgroups_world2", 3, "fp32", "subgroups"),
                                       ("fp16_zero3_world2", 3, "fp16", "-"),
                                       ("fp16_unstepped_zero2_world2", 2, "fp16", "unstepped"),
                                       ("bnb_zero2_world2", 2, "bf16", "bnb"),
                                       ("pipe2_zero1_world4", 1, "fp32", "pipe"),
                                       ("bf16_pipe2_zero0_world4", 0, "bf16", "pipe_bf16"),
                                       ("autotp2_zero1_world2", 1, "fp32", "autotp"),
                                       ("moe_zero1_world4", 1, "fp32", "moe"),
                                       ("moe_zero0_world4", 0, "fp32", "moe"),
                                       ("moe_bf16_fused_zero0_world4", 0, "bf16", "moe"),
                                       ("autoep_zero1_world4", 1, "fp32", "autoep")):
        if wanted and name not in wanted:
            continue
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        ranks = 4 if variant in ("pipe", "pipe_bf16", "moe", "autoep") else 2
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
                        str(stage), half, str(out), variant], check=True, env=env)
        for extra in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's recovery scripts: not state
            (out / extra).unlink(missing_ok=True)
        print(f"wrote {out}")
    # ds_to_universal writes `latest_universal` beside its output: made elsewhere, the folder copied
    import tempfile
    for source in ("zero3_world2", "zero3_subgroups_world2"):
        name = source + "_universal"
        if wanted and name not in wanted:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            str(HERE / source / "global_step3"), "--output_folder", f"{tmp}/u",
                            "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            out = HERE / name
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(f"{tmp}/u", out)
            print(f"wrote {out}")


if __name__ == "__main__":
    main()
