"""ZeRO-1 training on any number of ranks, with sharded checkpoints that resume on a different number.

Run under torchrun (or tests/dist/launch.sh), CPU, gloo:

    python -m torch.distributed.run --standalone --nproc-per-node 2 samples/train_sharded.py \
        --optimizer adamw8bit --steps 20 --save /tmp/ck
    python -m torch.distributed.run --standalone --nproc-per-node 3 samples/train_sharded.py \
        --optimizer adamw8bit --resume /tmp/ck --steps 20 --save /tmp/ck2

Every rank computes the whole gradient of the same batch (batches depend only on the step number),
so the run is the same computation whatever the number of ranks: a resumed run's final checkpoint
hashes exactly like an uninterrupted one's. Each rank steps only its ranges of the parameters
(optstate.ShardedParams), saves them in parallel, and after a resume checks its live shard against
the checkpoint (optstate.verify).
"""
import argparse
import sys

import torch
import torch.distributed as dist

import optstate


def make_model():
    torch.manual_seed(0)
    # 8-bit eligible (>= 4096 elements) and small params, uneven rows for every world size 1-4.
    return torch.nn.Sequential(torch.nn.Linear(48, 97), torch.nn.GELU(), torch.nn.Linear(97, 67), torch.nn.GELU(),
                               torch.nn.Linear(67, 5))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 48, generator=g)
    y = torch.randn(64, 5, generator=g)
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=["adamw", "adamw8bit"], default="adamw")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--resume")
    ap.add_argument("--save")
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args()

    # torchrun gives each of several ranks one thread but leaves a single rank all cores; matmul
    # results depend on the thread count, so fix it for runs that must agree bit for bit.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    if args.optimizer == "adamw8bit":
        shards = optstate.ShardedParams(model, block_size=args.block_size)
        opt = optstate.AdamW8bit(shards.parameters(), lr=2e-3, weight_decay=0.1, block_size=args.block_size)
    else:
        shards = optstate.ShardedParams(model)
        opt = optstate.FusedAdamW(shards.parameters(), lr=2e-3, weight_decay=0.1)

    start = 0
    if args.resume:
        optstate.load(args.resume, shards, opt)
        problems = optstate.verify(args.resume, shards, opt)
        if problems:
            print(f"rank {rank}: resume check FAILED:", *problems, sep="\n  ", file=sys.stderr)
            sys.exit(1)
        start = int(next(iter(opt.state.values()))["step"].item())
        if rank == 0:
            print(f"resumed {args.resume} on {world} ranks at step {start}; every rank's live shard equals the checkpoint")

    for step in range(start, start + args.steps):
        x, y = batch(step)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        shards.scatter_grads()
        opt.step()
        shards.gather_params()
    if rank == 0:
        print(f"{args.optimizer} on {world} ranks: step {start + args.steps}, loss {loss.item():.6f}")
    if args.save:
        optstate.save(args.save, shards, opt)
        if rank == 0:
            print(f"saved {args.save} ({world} rank files)")
    # together: torch 2.13 + gloo aborts now and then (SIGABRT) when one rank destroys its group early
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
