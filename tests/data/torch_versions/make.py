"""Writes one torch release's checkpoints for the cross-version corpus: run it in a venv that has
that release (and torchao, when there is one for it), e.g.

    python tests/data/torch_versions/make.py tests/data/torch_versions/torch-2.6.0

Users' checkpoints come from many torch and torchao releases, while the suite's own scripts write
with the one in .venv; the pickles in these files (DCP's Metadata and its storage records, DTensor
and DeviceMesh, torchao's OptimState8bit, which lived in torchao.prototype.low_bit_optim before
torchao 0.11) are what changes between releases. Written into OUT:

- `optimizer.pt`: `torch.save({"model": ..., "optimizer": ...})` of torch.optim.AdamW, two param
  groups (weight decay on the matrices only), one process;
- `dcp/`: `dcp.save({"model", "optim"})` of get_state_dict under FSDP2 on two CPU ranks (gloo);
- `fsdp2_world2/`: what verl saves per rank under FSDP2 (`model_/optim_world_size_2_rank_R.pt`
  of DTensors);
- `fsdp1_world2/`: the same under FSDP1 (flat parameters, a device mesh: DTensors), verl's older
  default;
- with torchao: `torchao_optimizer.pt` (Hugging Face Trainer's `optimizer.pt` under
  `optim="adamw_torch_8bit"`: the state_dict alone, params numbered) and `torchao_dcp/` (FSDP2, two
  ranks, each rank's 4096-element half of the weight quantized by torchao).
Before torch 2.7, FSDP2 does not run on the CPU (its CPU stream has no record_event): such a
release writes `dcp/` and `torchao_dcp/` from one process and no `fsdp2_world2/`; torchao 0.5
cannot dcp.save its state at all (its subclass lacks `aten.is_pinned`), so no `torchao_dcp/` there.
- `<name>.ref.safetensors` beside each: the state as this release holds it, gathered over ranks
  by torch itself, widened to fp32 with torchao's own dequantize(), named as optstate names
  entries (`<fqn>.exp_avg`, `<fqn>.param`); its metadata holds the steps and the hyperparameters
  (`"ref"`: JSON), and the writer's versions (`"torch"`, `"torchao"`).

tests/python/test_torch_versions.py reads every release's folder with optstate and compares.
torch.compile is replaced by eager execution in torchao's step (its compiled step needs a C++
toolchain and mixes up DTensor shapes on CPU); only the state it leaves matters here.
"""
import json
import os
import shutil
import socket
import sys

import torch


def torchao_adamw8bit():
    """torchao's AdamW8bit where this release keeps it, or None."""
    torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        try:
            from torchao.prototype.low_bit_optim import AdamW8bit
        except ImportError:
            return None
    return AdamW8bit


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))


def wide_model():
    # 256x32: 4096 elements a rank over two, torchao's smallest quantized size
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256, bias=False), torch.nn.Linear(256, 4))


def adamw(model):
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.95))


def train(model, opt, rank, width=16, steps=2):
    for step in range(steps):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()


def plain(t):
    """A state tensor as fp32 values: this rank's part of a DTensor, dequantized as torchao does."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "dequantize"):
        t = t.dequantize()
    return t.detach().float().contiguous()


def write_ref(path, model, opt, gather=None, numbered=False, weights=True):
    """Saves what `opt` holds for `model`'s params as <path>.ref.safetensors (rank 0 of `gather`).
    `numbered`: a state_dict saved without the model, whose params optstate names by their index
    in the groups (no weights). `weights=False` leaves the weights out (the torchao sets: their
    moments are what is at stake, and the corpus stays small)."""
    names = {p: n for n, p in model.named_parameters()}
    tensors, meta = {}, {}
    index = 0
    for group in opt.param_groups:
        for p in group["params"]:
            fqn, st = (str(index) if numbered else names[p]), opt.state[p]
            index += 1
            parts = {"param": p.data} if weights and not numbered else {}
            parts.update({k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st})
            for k, v in parts.items():
                v = plain(v)
                if gather is not None:  # FSDP2's Shard(0): every rank's rows, in rank order
                    import torch.distributed as dist
                    pieces = [None] * dist.get_world_size()
                    dist.all_gather_object(pieces, v)
                    v = torch.cat(pieces)
                tensors[f"{fqn}.{k}"] = v.reshape(p.shape).contiguous()
            meta[fqn] = hyperparameters(st, group)
    if gather is None or gather == 0:
        save_ref(path, tensors, meta)


def hyperparameters(st, group):
    """What the reference records of a param besides its tensors: its step and its group's settings."""
    return {"step": int(plain(st["step"]).item()), "lr": float(group["lr"]), "betas": list(group["betas"]),
            "eps": group["eps"], "weight_decay": group["weight_decay"]}


def save_ref(path, tensors, meta):
    from safetensors.torch import save_file

    try:
        import torchao
        ao = torchao.__version__
    except ImportError:
        ao = ""
    save_file(tensors, path + ".ref.safetensors",
              metadata={"ref": json.dumps(meta, sort_keys=True), "torch": torch.__version__, "torchao": ao})


def fsdp1_files(rank, world, out):
    """verl's per-rank files under FSDP1 (flat parameters, one unit per Linear, a device mesh so
    that the sharded state dicts hold DTensors), and torch's own full gather of the same state
    (FSDP.optim_state_dict under FULL_STATE_DICT) as the reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(small_model(), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                 device_mesh=init_device_mesh("cpu", (world,)), device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    train(model, opt, rank)
    folder = os.path.join(out, "fsdp1_world2")
    os.makedirs(folder, exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        torch.save(model.state_dict(), f"{folder}/model_world_size_{world}_rank_{rank}.pt")
        torch.save(opt.state_dict(), f"{folder}/optim_world_size_{world}_rank_{rank}.pt")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        weights = model.state_dict()
        full = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        (group,) = full["param_groups"]
        tensors, meta = {}, {}
        for fqn, st in full["state"].items():
            tensors[f"{fqn}.param"] = weights[fqn].float().contiguous()
            for k in ("exp_avg", "exp_avg_sq"):
                tensors[f"{fqn}.{k}"] = st[k].float().contiguous()
            meta[fqn] = hyperparameters(st, group)
        save_ref(folder, tensors, meta)


def fsdp2_on_cpu():
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)


def save_dcp(path, model, opt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def one_process(out):
    model = small_model()
    opt = adamw(model)
    train(model, opt, 0)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(out, "optimizer.pt"))
    write_ref(os.path.join(out, "optimizer.pt"), model, opt)
    if not fsdp2_on_cpu():
        save_dcp(os.path.join(out, "dcp"), model, opt)
        write_ref(os.path.join(out, "dcp"), model, opt)
    AdamW8bit = torchao_adamw8bit()
    if AdamW8bit is not None:
        model = wide_model()
        opt = AdamW8bit(model.parameters(), lr=1e-3)
        train(model, opt, 0, width=32)
        torch.save(opt.state_dict(), os.path.join(out, "torchao_optimizer.pt"))
        write_ref(os.path.join(out, "torchao_optimizer.pt"), model, opt, numbered=True)
        if not fsdp2_on_cpu():
            try:
                save_dcp(os.path.join(out, "torchao_dcp"), model, opt)
            except BaseException as e:  # torchao 0.5's subclass lacks ops DCP's save calls
                # (DCP's CheckpointException is a BaseException whose text holds each rank's error)
                if "unimplemented operator" not in str(e):
                    raise
                print("no torchao_dcp/: this torchao cannot dcp.save its state", file=sys.stderr)
                shutil.rmtree(os.path.join(out, "torchao_dcp"), ignore_errors=True)
            else:
                write_ref(os.path.join(out, "torchao_dcp"), model, opt, weights=False)


def join_gloo(rank, world, port):
    """Joins the writer's local process group (gloo over `port`, spawn_ranks')."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def fsdp2_sharded(make):
    """make()'s model under FSDP2: each Linear a unit of its own, the model the root (Shard(0) rows)."""
    from torch.distributed.fsdp import fully_shard

    model = make()
    for m in list(model)[::2] + [model]:
        fully_shard(m)
    return model


def rank_main(rank, world, port, out):
    import torch.distributed as dist

    join_gloo(rank, world, port)
    fsdp1_files(rank, world, out)
    if fsdp2_on_cpu():
        fsdp2_files(rank, world, out)
    dist.barrier()
    dist.destroy_process_group()


def fsdp2_files(rank, world, out):
    AdamW8bit = torchao_adamw8bit()
    model = fsdp2_sharded(small_model)
    opt = adamw(model)
    train(model, opt, rank)
    save_dcp(os.path.join(out, "dcp"), model, opt)
    write_ref(os.path.join(out, "dcp"), model, opt, gather=rank)
    verl = os.path.join(out, "fsdp2_world2")
    os.makedirs(verl, exist_ok=True)
    torch.save(model.state_dict(), f"{verl}/model_world_size_{world}_rank_{rank}.pt")
    torch.save(opt.state_dict(), f"{verl}/optim_world_size_{world}_rank_{rank}.pt")
    write_ref(verl, model, opt, gather=rank)
    if AdamW8bit is not None:
        model = fsdp2_sharded(wide_model)
        opt = AdamW8bit(model.parameters(), lr=1e-3)
        train(model, opt, rank, width=32)
        save_dcp(os.path.join(out, "torchao_dcp"), model, opt)
        write_ref(os.path.join(out, "torchao_dcp"), model, opt, gather=rank, weights=False)


def spawn_ranks(rank_main, out, world=2):
    """Runs rank_main(rank, world, port, out) on `world` local processes (gloo over a free port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(world, port, out), nprocs=world)


def enter_cpu_mode(cuda_types=False):
    """For a writer script whose stack places tensors on CUDA: from here on in this process, every
    torch call's device='cuda...' (and .to('cuda...')) is the CPU, .cuda() a no-op,
    torch.cuda.current_device() 'cpu'; with `cuda_types`, a tensor's type() names torch.cuda's
    class (Megatron-Core checks it)."""
    from torch.overrides import TorchFunctionMode

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None

    def cpu(d):
        if isinstance(d, torch.device) and d.type == "cuda":
            return torch.device("cpu")
        if isinstance(d, str) and d.startswith("cuda"):
            return "cpu"
        return d

    class CpuMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            name = getattr(func, "__name__", "")
            if name == "cuda":
                return args[0]
            if cuda_types and name == "type" and len(args) == 1 and not kwargs:
                r = func(*args)
                return r.replace("torch.", "torch.cuda.", 1) if r.startswith("torch.") and ".cuda." not in r else r
            if name == "to" and len(args) > 1 and isinstance(args[1], (str, torch.device)):
                args = (args[0], cpu(args[1])) + tuple(args[2:])
            return func(*args, **kwargs)

    CpuMode().__enter__()


def spawn_main(rank_main):
    """A writer script's main: rank_main(rank, world, port, out) on two ranks, out = argv[1]."""
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    spawn_ranks(rank_main, out)


def main():
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    one_process(out)
    spawn_ranks(rank_main, out)


if __name__ == "__main__":
    main()
