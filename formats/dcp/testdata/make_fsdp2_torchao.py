"""Writes testdata/fsdp2_torchao/: a DCP (get_state_dict's {"model", "optim"}) of torchao's
AdamW8bit under FSDP2 on two CPU processes (gloo), and fsdp2_torchao_values/<fqn>.<moment>.f32,
what each moment is by torchao's own dequantize() of every rank's part, put together by rows (raw
little-endian float32, flattened). The weight 257x32
splits into 129 rows (4128 elements: not whole blocks of 256, so torchao keeps that shard plain)
and 128 rows (4096: quantized): one item with a plain chunk and an OptimState8bit chunk. The
257x16 weight (2056 elements a rank) stays plain everywhere. torch.compile is replaced by eager in torchao's
step (its compiled step mixes up DTensor shapes on CPU); only the state it leaves matters here.

    .venv/bin/python formats/dcp/testdata/make_fsdp2_torchao.py
"""
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def rank_main(rank, world):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchao.optim import AdamW8bit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29455")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.compile = lambda fn, **kwargs: fn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 257, bias=False), torch.nn.Linear(257, 16, bias=False))
    for m in (model[0], model[1], model):
        fully_shard(m)
    opt = AdamW8bit(model.parameters(), lr=1e-3)
    for step in range(2):
        model(torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(HERE, "fsdp2_torchao"))
    names = {p: n for n, p in model.named_parameters()}
    local = {}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            v = st[k].to_local() if isinstance(st[k], DTensor) else st[k]
            local[f"{names[p]}.{k}"] = v.dequantize() if hasattr(v, "dequantize") else v
    parts = [None] * world
    dist.all_gather_object(parts, local)
    if rank == 0:
        out = os.path.join(HERE, "fsdp2_torchao_values")
        os.makedirs(out, exist_ok=True)
        for k in local:
            with open(os.path.join(out, f"{k}.f32"), "wb") as f:
                f.write(torch.cat([p[k] for p in parts]).contiguous().numpy().tobytes())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(2,), nprocs=2)
