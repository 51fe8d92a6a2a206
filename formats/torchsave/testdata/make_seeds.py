"""Writes the torch.save seeds of the torchsave driver's tests and fuzz target (run from the repo root:
.venv/bin/python formats/torchsave/testdata/make_seeds.py). Each is what a real writer gives for a
tiny model (Linear(64, 64), two steps): torch.optim.AdamW (amsgrad, params unnamed), torchao's
AdamW8bit (OptimState8bit moments for the 64x64 weight, a tensor lr), optstate.AdamW8bit built from
named_parameters (param_names, plain codes/absmax tensors), and a {"model", "optimizer"} checkpoint."""
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


if __name__ == "__main__":
    main()
