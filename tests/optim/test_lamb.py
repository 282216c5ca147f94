"""LAMB on one process against the paper's update written here in float64 (You et al. 2019,
Algorithm 2, with Adam's bias correction): several steps, weight decay on some parameters
only, a parameter whose norm is zero (trust ratio 1) and one whose update is zero."""

from __future__ import annotations

import math

import pytest
import torch

from megascale.optim import Lamb

B1, B2, EPS, LR, WD = 0.9, 0.95, 1e-6, 0.05, 0.1


def reference_lamb(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], decay: list[bool]
) -> list[torch.Tensor]:
    """Float64 LAMB: r = m^/(sqrt(v^)+eps); u = r + wd*w; w -= lr * ||w||/||u|| * u,
    with the ratio taken as 1 when either norm is zero."""
    w = [p.double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            g = g.double()
            m[i] = B1 * m[i] + (1 - B1) * g
            v[i] = B2 * v[i] + (1 - B2) * g * g
            m_hat = m[i] / (1 - B1**t)
            v_hat = v[i] / (1 - B2**t)
            u = m_hat / (v_hat.sqrt() + EPS) + (WD * w[i] if decay[i] else 0.0)
            w_norm = math.sqrt(float((w[i] * w[i]).sum()))
            u_norm = math.sqrt(float((u * u).sum()))
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w[i] = w[i] - LR * ratio * u
    return w


def test_lamb_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    params = [
        torch.randn(6, 5, generator=g) * 0.5,  # matrix, decayed
        torch.randn(7, generator=g) * 3.0,  # vector, not decayed
        torch.zeros(4, 3),  # zero norm: trust ratio 1 (the first update is lr * u)
        torch.randn(5, generator=g),  # zero gradient: zero update, ratio 1, stays put
    ]
    decay = [True, False, True, False]
    steps = 6
    grads = [
        [torch.randn(p.shape, generator=g) * (0.0 if i == 3 else 10.0 ** (i - 1)) for i, p in enumerate(params)]
        for _ in range(steps)
    ]

    tensors = [p.clone() for p in params]
    opt = Lamb(
        [
            {"params": [t for t, d in zip(tensors, decay, strict=True) if d], "weight_decay": WD},
            {"params": [t for t, d in zip(tensors, decay, strict=True) if not d]},
        ],
        lr=LR,
        betas=(B1, B2),
        eps=EPS,
    )
    for step_grads in grads:
        for t, gr in zip(tensors, step_grads, strict=True):
            t.grad = gr.clone()
        opt.step()

    want = reference_lamb(params, grads, decay)
    for i, (got, ref) in enumerate(zip(tensors, want, strict=True)):
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6), i
    assert torch.equal(tensors[3], params[3])
    assert tensors[2].abs().sum() > 0  # the zero-norm parameter moved (ratio 1, not 0/0)


def test_trust_ratio_makes_the_step_scale_free():
    """LAMB's layer-wise adaptation: scaling a weight scales its step (Adam's would not)."""
    g = torch.Generator().manual_seed(1)
    w, grad = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    steps = []
    for scale in (1.0, 10.0):
        t = (w * scale).clone()
        t.grad = grad.clone()
        Lamb([t], lr=LR, betas=(B1, B2), eps=EPS).step()
        steps.append((t - w * scale).norm().item())
    assert steps[1] == pytest.approx(10 * steps[0], rel=1e-4)


def test_lamb_rejects_bad_hyperparameters():
    with pytest.raises(ValueError):
        Lamb([torch.zeros(2)], lr=-1e-3)
    with pytest.raises(ValueError):
        Lamb([torch.zeros(2)], betas=(1.0, 0.9))


def test_lamb_with_lr_zero_leaves_the_weights():
    """optim.lr=0 (an evaluation run) is allowed and changes nothing, weight decay included."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    opt = Lamb([p], lr=0.0, weight_decay=0.1)
    p.grad = torch.randn(4, 3)
    opt.step()
    assert torch.equal(p.detach(), before)
