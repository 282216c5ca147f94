"""The vocabulary projection and the summed token loss over chunks of tokens: whole logits never exist.

Whole logits are tokens x vocabulary floats: 2 GiB for one 4k-token sequence at vocabulary
128k, and the plain backward holds two or three more such tensors. Here each chunk of tokens
has its logits computed, reduced to its loss, and turned at once into its share of the input
and weight gradients (softmax minus one-hot, then the two GEMMs the plain backward would run),
so at most one chunk's logits are alive, in the forward and in the backward.

The gradients are computed in the forward (the loss is a scalar sum: the backward only scales
them by the incoming gradient) rather than by recomputing every chunk's logits in the backward:
that would be a fourth GEMM of the largest matrix product of the model, about 1.33x the time.
Without grad mode nothing is kept and no gradient is computed.

Vocabulary-parallel use (megascale.parallel.tensor): `weight` holds the rows
`[vocab_start, vocab_start + V_local)` and `combine` merges each token's log-sum-exp and target
logit across the shards (one collective per chunk), so the loss is the same on every shard and
each shard's gradients are its part of the whole ones. No parallel code lives here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import Function

IGNORE_INDEX = -100

# (local log-sum-exp, local target logit) of a chunk's tokens -> the same over the whole vocabulary
Combine = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _chunk(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    combine: Combine | None,
    grad_x: torch.Tensor | None,
    grad_w: torch.Tensor | None,
) -> torch.Tensor:
    """The summed loss of one chunk of tokens; its gradients written into `grad_x` (this chunk's
    rows) and added to `grad_w`. Its logits die when it returns (one chunk alive at a time)."""
    local_vocab = weight.shape[0]
    logits = (x @ weight.t()).float()
    local = labels - vocab_start
    inside = (local >= 0) & (local < local_vocab)
    index = local.clamp(0, local_vocab - 1).unsqueeze(-1)
    target = logits.gather(-1, index).squeeze(-1).masked_fill(~inside, 0.0)
    top = logits.amax(-1)
    exp = logits.sub_(top.unsqueeze(-1)).exp_()  # in place: one chunk-sized buffer
    lse = exp.sum(-1).log_().add_(top)
    lse_all, target = (lse, target) if combine is None else combine(lse, target)
    valid = labels != IGNORE_INDEX
    loss = (lse_all - target).masked_fill(~valid, 0.0).sum()
    if grad_x is None and grad_w is None:
        return loss
    # softmax over the whole vocabulary, minus the one-hot target, for valid tokens
    grad = exp.mul_((top - lse_all).exp_().masked_fill_(~valid, 0.0).unsqueeze(-1))
    grad.scatter_add_(-1, index, -(inside & valid).unsqueeze(-1).to(grad.dtype))
    grad = grad.to(x.dtype)
    if grad_x is not None:
        torch.mm(grad, weight, out=grad_x)
    if grad_w is not None and grad_w.dtype == grad.dtype:
        grad_w.addmm_(grad.t(), x)
    elif grad_w is not None:  # bf16 GEMM, fp32 sum over chunks
        grad_w += grad.t() @ x
    return loss


class _ChunkedLinearCrossEntropy(Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        vocab_start: int,
        combine: Combine | None,
        grads: bool,
    ) -> torch.Tensor:
        want_x, want_w = (grads and ctx.needs_input_grad[0]), (grads and ctx.needs_input_grad[1])
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        with torch.autocast(x.device.type, enabled=False):  # the caller chose the GEMM dtype
            for start in range(0, x.shape[0], chunk):
                rows = slice(start, start + chunk)
                total += _chunk(
                    x[rows],
                    weight,
                    labels[rows],
                    vocab_start,
                    combine,
                    None if grad_x is None else grad_x[rows],
                    grad_w,
                )
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        # in place: the forward's buffers are not needed again (a second backward is refused)
        gx = None if grad_x is None else grad_x.mul_(grad_total.to(grad_x.dtype))
        gw = None if grad_w is None else grad_w.mul_(grad_total).to(ctx.weight_dtype)
        return gx, gw, None, None, None, None, None


def chunked_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    vocab_start: int = 0,
    combine: Combine | None = None,
) -> torch.Tensor:
    """Sum over tokens of cross_entropy(x @ weight.T, labels) (0 where `labels == -100`), with
    fp32 logits, `chunk` tokens at a time. x: `[tokens, hidden]`, weight: `[V_local, hidden]`,
    labels: `[tokens]` (whole-vocabulary ids). Under autocast the GEMMs run in its dtype, as
    `F.linear` would."""
    if chunk < 1:
        raise ValueError(f"train.loss_chunk must be >= 1 token, got {chunk}")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    return _ChunkedLinearCrossEntropy.apply(x, weight, labels, chunk, vocab_start, combine, torch.is_grad_enabled())
