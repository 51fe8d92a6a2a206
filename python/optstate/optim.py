"""optstate optimizers as torch.optim.Optimizer subclasses. The update itself is the C++ kernel."""
import torch

from ._ops import ops


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW semantics) with one fused pass per element over all parameters.

    State per parameter: ``step`` (float32 scalar tensor, as torch's AdamW), ``exp_avg`` and
    ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), always float32, also for bf16 params.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 maximize=False):
        if isinstance(lr, torch.Tensor):
            raise ValueError("FusedAdamW: lr must be a float")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults)

    def _init_state(self, p, amsgrad):
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                       memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, m, v, vmax, steps = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                state = self._init_state(p, group["amsgrad"])
                params.append(p)
                grads.append(p.grad.contiguous())
                m.append(state["exp_avg"])
                v.append(state["exp_avg_sq"])
                if group["amsgrad"]:
                    vmax.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            ops.fused_adamw_(params, grads, m, v, vmax, steps, float(group["lr"]), float(beta1), float(beta2),
                             float(group["eps"]), float(group["weight_decay"]), bool(group["amsgrad"]),
                             bool(group["maximize"]))
        return loss
