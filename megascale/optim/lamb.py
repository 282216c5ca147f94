"""LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019), shard-aware.

Per parameter:  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  bias-corrected m^, v^;
u = m^ / (sqrt(v^) + eps) + wd * w;  r = ||w|| / ||u|| (1 when either norm is 0);  w -= lr r u.
Norms are of the *whole* parameter and update even when this process holds only a shard
(ZeRO, tensor parallelism): `megascale.optim.norms` sums the pieces over the groups the shard
records. Weight decay is chosen per parameter group (none on biases and norms).
"""

from __future__ import annotations

import math

import torch

from megascale.optim.norms import SumOver, all_reduce, whole_sq_norms


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        sum_over: SumOver = all_reduce,
    ):
        """`sum_over`: how the shards' norms are summed over their groups (`optim.norms`)."""
        if lr < 0 or eps <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.sum_over = sum_over

    @torch.no_grad()
    def step(self, closure=None):
        """Multi-tensor (`torch._foreach_*`) kernels over each group, and no read-back to the
        host: the trust ratios stay on the device, so the CPU never waits for the GPU here."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            b1, b2 = group["betas"]
            grads = [p.grad for p in params]
            m, v, steps = self._moments(params)
            torch._foreach_mul_(m, b1)
            torch._foreach_add_(m, grads, alpha=1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
            # u = m^ / (sqrt(v^) + eps) with m^ = m / (1 - b1^t), v^ = v / (1 - b2^t)
            updates = torch._foreach_sqrt(v)
            torch._foreach_div_(updates, [math.sqrt(1 - b2**t) for t in steps])
            torch._foreach_add_(updates, group["eps"])
            torch._foreach_reciprocal_(updates)
            torch._foreach_mul_(updates, m)
            torch._foreach_div_(updates, [1 - b1**t for t in steps])
            if group["weight_decay"]:
                torch._foreach_add_(updates, params, alpha=group["weight_decay"])
            w_norm = whole_sq_norms(params, params, self.sum_over).sqrt()
            u_norm = whole_sq_norms(updates, params, self.sum_over).sqrt()
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            scale = (trust * -group["lr"]).to(params[0].dtype).unbind()
            torch._foreach_mul_(updates, scale)
            torch._foreach_add_(params, updates)
        return loss

    def _moments(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """Each parameter's first and second moments, created at its first step, and its step
        count after this one (kept per parameter, as torch's optimizers keep it)."""
        m, v, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            m.append(state["exp_avg"])
            v.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return m, v, steps
