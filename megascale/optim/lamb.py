"""LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019), shard-aware.

Per parameter:  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  bias-corrected m^, v^;
u = m^ / (sqrt(v^) + eps) + wd * w;  r = ||w|| / ||u|| (1 when either norm is 0);  w -= lr r u.
Norms are of the *whole* parameter and update even when this process holds only a shard
(ZeRO, tensor parallelism): `megascale.optim.norms` sums the pieces over the groups the shard
records. Weight decay is chosen per parameter group (none on biases and norms).
"""

from __future__ import annotations

import torch

from megascale.optim.norms import whole_sq_norms


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ):
        if lr <= 0 or eps <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            b1, b2 = group["betas"]
            updates = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = m / (1 - b1 ** state["step"])
                v_hat = v / (1 - b2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                updates.append(update)
            w_norm = whole_sq_norms(params, params).sqrt()
            u_norm = whole_sq_norms(updates, params).sqrt()
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            for p, update, ratio in zip(params, updates, trust.tolist(), strict=False):
                p.add_(update, alpha=-group["lr"] * ratio)
        return loss
