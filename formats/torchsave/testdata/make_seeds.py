"""Writes the torch.save seeds of the torchsave driver's tests and fuzz target (run from the repo root:
.venv/bin/python formats/torchsave/testdata/make_seeds.py). Each is what a real writer gives for a
tiny model (Linear(64, 64), two steps): torch.optim.AdamW (amsgrad, params unnamed), torchao's
AdamW8bit (OptimState8bit moments for the 64x64 weight, a tensor lr), optstate.AdamW8bit built from
named_parameters (param_names, plain codes/absmax tensors), a {"model", "optimizer"} checkpoint, and
torch.optim.AdamW's state keyed by fqn in two groups (get_optimizer_state_dict).

FSDP2 (two CPU processes over gloo): fsdp2_world2/ holds what verl saves per rank
(optim_world_size_2_rank_R.pt, model_world_size_2_rank_R.pt of DTensors, extra_state_...), and
fsdp2_world2_full.pt the same state put together by torch itself (DTensor.full_tensor()) as one
{"model", "optimizer"} file with param_names; fsdp2_world1_optim.pt is one rank's file of a
one-rank run (DTensors on a mesh of one)."""
import os

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
    _, opt = trained(lambda p: optstate.AdamW8bit(p, lr=1e-3, block_size=256), named=True)
    torch.save(opt.state_dict(), os.path.join(HERE, "optstate_adamw8bit_named.pt"))
    model, opt = trained(lambda p: torch.optim.AdamW(p, lr=1e-3), named=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2},
               os.path.join(HERE, "torch_model_and_optimizer.pt"))


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


if __name__ == "__main__":
    main()
    fqn()
    fsdp2()
