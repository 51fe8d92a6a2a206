"""Writes the torch.save seeds of the torchsave driver's tests and fuzz target (run from the repo root:
.venv/bin/python formats/torchsave/testdata/make_seeds.py). Each is what a real writer gives for a
tiny model (Linear(64, 64), two steps): torch.optim.AdamW (amsgrad, params unnamed), torchao's
AdamW8bit (OptimState8bit moments for the 64x64 weight, a tensor lr), AdamWFp8 and AdamW4bit,
optstate.AdamW8bit built from named_parameters (param_names, plain codes/absmax tensors), a
{"model", "optimizer"} checkpoint, and
torch.optim.AdamW's state keyed by fqn in two groups (get_optimizer_state_dict); bitsandbytes'
AdamW8bit as 0.50 saves it and in its older layout (bnb); a {"model", "optimizer"} checkpoint of
numbered params in decay / no-decay groups beside a model with a tied weight and BatchNorm buffers,
named from the model (numbered); a {"model", "optimizer"} checkpoint of a channels_last conv model,
its weights and moments stored permuted (channels_last); nanoGPT's of a compiled model, every model
key under '_orig_mod.' (compiled); buffers of complex64, int16, bool, float8 and uint16 beside a
model's params (rotary); a DDP run's, every model key under 'module.' (ddp); torchtune's
recipe_state.pt of a run with optimizer_in_bwd, an optimizer per param keyed by its name
(in_backward); DeepSpeed's FusedAdam's {"model", "optimizer"}, its group's step count on the last
param's state only (deepspeed_fused_adam).

FSDP2 (two CPU processes over gloo): fsdp2_world2/ holds what verl saves per rank
(optim_world_size_2_rank_R.pt, model_world_size_2_rank_R.pt of DTensors, extra_state_...), and
fsdp2_world2_full.pt the same state put together by torch itself (DTensor.full_tensor()) as one
{"model", "optimizer"} file with param_names; fsdp2_world1_optim.pt is one rank's file of a
one-rank run (DTensors on a mesh of one).

FSDP1 (FullyShardedDataParallel, two CPU processes, device_id=cpu): fsdp1_world2/ is what verl's FSDP
strategy saves per rank with use_orig_params=False (its default: the optimizer steps one flat
parameter per unit), fsdp1_world2_orig/ with use_orig_params=True (one param each, a run of it or
nothing per rank); fsdp1_world2*_full.pt the same state put together from FSDP's own flat-parameter
metadata (where each rank's run of each param starts), as one {"model", "optimizer"} file.

    .venv/bin/python formats/torchsave/testdata/make_seeds.py [main|fqn|fsdp2|fsdp1|bnb|numbered|channels_last|compiled|rotary|ddp|in_backward|deepspeed_fused_adam]"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def trained(make_opt, named=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = make_opt(model.named_parameters() if named else model.parameters())
    for _ in range(2):
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def main():
    import optstate
    from torchao.optim import AdamW8bit

    _, opt = trained(lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True))
    torch.save(opt.state_dict(), os.path.join(HERE, "torch_adamw_amsgrad.pt"))
    _, opt = trained(lambda p: AdamW8bit(p, lr=1e-3, block_size=256))
    torch.save(opt.state_dict(), os.path.join(HERE, "torchao_adamw8bit.pt"))
    from torchao.optim import AdamW4bit, AdamWFp8
    _, opt = trained(lambda p: AdamWFp8(p, lr=1e-3))
    torch.save(opt.state_dict(), os.path.join(HERE, "torchao_adamwfp8.pt"))
    _, opt = trained(lambda p: AdamW4bit(p, lr=1e-3))
    torch.save(opt.state_dict(), os.path.join(HERE, "torchao_adamw4bit.pt"))
    _, opt = trained(lambda p: optstate.AdamW8bit(p, lr=1e-3, block_size=256), named=True)
    torch.save(opt.state_dict(), os.path.join(HERE, "optstate_adamw8bit_named.pt"))
    model, opt = trained(lambda p: torch.optim.AdamW(p, lr=1e-3), named=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2},
               os.path.join(HERE, "torch_model_and_optimizer.pt"))


def nanogpt_file(model, name, compile=False):
    """nanoGPT's loop: an AdamW built from the parameters in two groups (2-d weights decayed, the rest
    not), the model compiled after it where asked (train.py's order), two steps, then
    torch.save({"model", "optimizer", "iter_num"}) of what the loop holds."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    if compile:
        model = torch.compile(model, backend="eager")
    for _ in range(2):
        model(torch.randint(0, 10, (4,))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 2}, os.path.join(HERE, name))


def numbered():
    """nanoGPT's way, numbered params: the model's head is tied to its embedding and a BatchNorm's
    buffers sit between params of their shape."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 10, bias=False))
    model[3].weight = model[0].weight
    nanogpt_file(model, "torch_numbered_model_and_optimizer.pt")


def compiled():
    """nanoGPT's train.py with compile=True: the model compiled after its optimizer was built, its
    state_dict keys all under '_orig_mod.' (the head tied to the embedding)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 10, bias=False))
    model[2].weight = model[0].weight
    nanogpt_file(model, "torch_compiled_model_and_optimizer.pt", compile=True)


def ddp():
    """A DistributedDataParallel run saved as many scripts save it: the wrapper's state_dict, every
    key under 'module.' (a one-rank gloo group; nanoGPT's loop otherwise)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29587")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 10))
    nanogpt_file(torch.nn.parallel.DistributedDataParallel(model), "torch_ddp_model_and_optimizer.pt")
    dist.destroy_process_group()


def in_backward():
    """torchtune's full finetune with optimizer_in_bwd: True: an optimizer per param, stepped by a
    post-accumulate-grad hook; recipe_state.pt holds OptimizerInBackwardWrapper.state_dict(), each
    param's optimizer state_dict under its name, beside the recipe's counters. The norm's params
    without decay, a warmup schedule per optimizer (initial_lr in each group), and a head the
    forward never uses: its optimizers never step (empty state)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16),
                                torch.nn.Linear(16, 2))
    optims = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.0 if p.dim() == 1 else 0.1)
              for p in model.parameters()}
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: (s + 1) / 4) for o in optims.values()]

    def step(p):
        optims[p].step()
        optims[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    for _ in range(2):
        model[:3](torch.randint(0, 16, (4, 3))).square().mean().backward()
        for s in scheds:
            s.step()
    wrapper = {n: optims[p].state_dict() for n, p in model.named_parameters()}
    torch.save({"optimizer": wrapper, "seed": 1234, "epochs_run": 1, "total_epochs": 3, "max_steps_per_epoch": None},
               os.path.join(HERE, "torchtune_optimizer_in_backward.pt"))


def rotary():
    """A model whose state_dict holds buffers of the other dtypes beside its params (torchtitan's
    llama keeps its rotary table as a persistent complex64 buffer; int16, bool, float8 and uint16
    buffers too),
    saved as {"model", "optimizer"} by an AdamW built from named_parameters (param_names)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    angles = torch.outer(torch.arange(4.0), torch.tensor([1.0, 0.1]))
    model.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=True)
    model.register_buffer("positions", torch.arange(4, dtype=torch.int16))
    model.register_buffer("keep", torch.tensor([True, False, True]))
    # dtypes torch pickles as an UntypedStorage and the dtype (_rebuild_tensor_v3): an fp8 base
    # model's frozen weight and its e8m0 scales, a uint16 table
    model.register_buffer("base_fp8", torch.tensor([[0.5, -1.0], [448.0, 0.0]]).to(torch.float8_e4m3fn))
    model.register_buffer("base_scale", torch.tensor([0.5, 4.0]).to(torch.float8_e8m0fnu))
    model.register_buffer("vocab_ids", torch.tensor([1, 60000], dtype=torch.int32).to(torch.uint16))
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randint(0, 10, (4,))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               os.path.join(HERE, "torch_rotary_model_and_optimizer.pt"))


def fqn():
    """torch.optim.AdamW's state keyed by fqn (get_optimizer_state_dict, FSDP.optim_state_dict), two
    groups as Hugging Face's Trainer makes them (weights decayed, biases not)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save(get_optimizer_state_dict(model, opt), os.path.join(HERE, "torch_adamw_fqn.pt"))


def channels_last():
    """A channels_last conv model under torch.optim.AdamW, saved as {"model", "optimizer"}: the conv
    weights and their moments stored as they lie in memory (permuted strides, not C-contiguous)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 2, 3)).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(2, 4, 7, 7).contiguous(memory_format=torch.channels_last)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert not opt.state[model[0].weight]["exp_avg"].is_contiguous()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               os.path.join(HERE, "torch_channels_last.pt"))


def fsdp2_rank(rank, world, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    for m in (model[0], model[2], model):
        fully_shard(m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    if world == 1:
        torch.save(opt.state_dict(), os.path.join(HERE, "fsdp2_world1_optim.pt"))
    else:
        os.makedirs(out, exist_ok=True)
        torch.save(model.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
        torch.save(opt.state_dict(), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
        torch.save({"lr_scheduler": None}, f"{out}/extra_state_world_size_{world}_rank_{rank}.pt")
        # torch's own gather, for the reference file.
        names = [n for n, _ in model.named_parameters()]
        full_model = {n: p.full_tensor() for n, p in model.named_parameters()}
        sd = opt.state_dict()
        full_state = {i: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in st.items()}
                      for i, st in sd["state"].items()}
        if rank == 0:
            groups = [dict(g, param_names=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
            torch.save({"model": full_model, "optimizer": {"state": full_state, "param_groups": groups}},
                       os.path.join(HERE, "fsdp2_world2_full.pt"))
    dist.barrier()
    dist.destroy_process_group()


def fsdp2():
    import torch.multiprocessing as mp

    mp.spawn(fsdp2_rank, args=(1, None), nprocs=1)
    mp.spawn(fsdp2_rank, args=(2, os.path.join(HERE, "fsdp2_world2")), nprocs=2)


def fsdp1_rank(rank, world, orig, out):
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29450 + int(orig)))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(8, 3), nn.LayerNorm(3), nn.Linear(3, 8, bias=False)

        def forward(self, x):
            return x + self.b(self.norm(torch.relu(self.a(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.layers, self.head = nn.Embedding(5, 8), nn.ModuleList([Block(), Block()]), nn.Linear(8, 3)

        def forward(self, x):
            x = self.emb(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    model = FSDP(Model(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig,
                 device_mesh=init_device_mesh("cpu", (world,)), device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        x = torch.randint(0, 5, (4, 3), generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    os.makedirs(out, exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        torch.save(model.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
        torch.save(opt.state_dict(), f"{out}/optim_world_size_{world}_rank_{rank}.pt")
    # The reference: each rank's runs placed by FSDP's flat-parameter metadata, gathered on rank 0.
    runs = []
    for name, mod in model.named_modules():
        if isinstance(mod, FSDP) and mod._handle is not None:
            flat = mod._handle.flat_param
            prefix = clean_tensor_name(name)
            for fqn, info, p in zip(flat._fqns, flat._shard_param_infos, flat._params or [None] * len(flat._fqns)):
                if info.in_shard:
                    st = opt.state[p] if orig else opt.state[flat]
                    lo = 0 if orig else info.offset_in_shard
                    runs.append(((prefix + "." if prefix else "") + fqn, info.intra_param_start_idx,
                                 {k: v.reshape(-1)[lo:lo + info.numel_in_shard].clone() for k, v in st.items() if k != "step"},
                                 st["step"].clone()))
    every = [None] * world
    dist.all_gather_object(every, runs)
    with FSDP.summon_full_params(model):
        weights = {clean_tensor_name(n): p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        names = list(weights)
        state = {}
        for rank_runs in every:
            for fqn, start, moments, step in rank_runs:
                st = state.setdefault(names.index(fqn), {"step": step})
                for k, v in moments.items():
                    full = st.setdefault(k, torch.zeros(weights[fqn].numel()))
                    full[start:start + v.numel()] = v
        for i, st in state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = st[k].reshape(weights[names[i]].shape)
        group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        group.update(params=sorted(state), param_names=[names[i] for i in sorted(state)])
        torch.save({"model": weights, "optimizer": {"state": state, "param_groups": [group]}}, f"{out}_full.pt")
    dist.barrier()
    dist.destroy_process_group()


def fsdp1():
    import torch.multiprocessing as mp

    mp.spawn(fsdp1_rank, args=(2, False, os.path.join(HERE, "fsdp1_world2")), nprocs=2)
    mp.spawn(fsdp1_rank, args=(2, True, os.path.join(HERE, "fsdp1_world2_orig")), nprocs=2)


def bnb():
    """bitsandbytes' AdamW8bit (CPU): bnb_adamw8bit_named.pt as bitsandbytes 0.50 saves it (built from
    named_parameters: param_names; the 8-bit tensors nested in "__bnb_optimizer_quant_state__", blocks
    of 256); bnb_adamw8bit_2048.pt the layout of older releases (the tensors beside "step", blocks of
    2048, no param_names), its codes and scales bitsandbytes' own quantize_blockwise of the same
    moments in blocks of 2048."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    _, opt = trained(lambda p: bnb.optim.AdamW8bit(p, lr=1e-3), named=True)
    sd = opt.state_dict()
    torch.save(sd, os.path.join(HERE, "bnb_adamw8bit_named.pt"))
    old = {"state": {}, "param_groups": [{k: v for k, v in g.items() if k not in ("param_names", "alpha", "t_alpha", "t_beta3")}
                                         for g in sd["param_groups"]]}
    for i, st in sd["state"].items():
        flat = {"step": st["step"], **st["__bnb_optimizer_quant_state__"]}
        for n in ("1", "2"):
            if flat["state" + n].dtype == torch.uint8:
                values = F.dequantize_blockwise(flat["state" + n], absmax=flat["absmax" + n], code=flat["qmap" + n],
                                                blocksize=256)
                codes, qs = F.quantize_blockwise(values, code=flat["qmap" + n], blocksize=2048)
                flat["state" + n], flat["absmax" + n] = codes, qs.absmax
        old["state"][i] = flat
    torch.save(old, os.path.join(HERE, "bnb_adamw8bit_2048.pt"))


def deepspeed_fused_adam():
    """DeepSpeed's FusedAdam (its CPU build: DS_ACCELERATOR=cpu) stepping Linear(64, 64) three times,
    saved as {"model", "optimizer"}: the group keeps 'bias_correction' and a 'step' of its own (0),
    and the count lives on the last param's state only (the weight's stays 0)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import FusedAdam
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    assert [st["step"] for st in sd["state"].values()] == [0, 3], sd["state"]
    torch.save({"model": model.state_dict(), "optimizer": sd}, os.path.join(HERE, "deepspeed_fused_adam.pt"))


if __name__ == "__main__":
    for step in sys.argv[1:] or ["main", "fqn", "fsdp2", "fsdp1", "bnb", "numbered", "channels_last", "compiled",
                                  "rotary", "ddp", "in_backward", "deepspeed_fused_adam"]:
        globals()[step]()
