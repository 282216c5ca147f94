"""Sliding-window attention that costs O(s*w) on any device, in plain PyTorch ("sliding chunks").

A band mask through SDPA computes all s*s scores and throws most away: on CPU a window makes
attention slower than full causal attention. Here the queries are cut into blocks of `block`
positions; block i attends only to the keys from block i - p to block i, where p =
ceil((w - 1) / block) blocks cover the window, so the scores of one block are `block x
(p + 1) * block` and the whole costs s * (w + block) pairs instead of s^2 / 2. The keys of every
block are a strided view (`unfold`) of the keys padded with p blocks in front; the
band (i - w < j <= i) and the padding are masked inside each block. Forward and backward are
batched GEMMs over all blocks at once; the backward is written out (the softmax is kept from the
forward, O(s*w) memory, its division by the row sums applied to the [.., d] output and output
gradient; the softmax backward's row sums come from dO * O, as FlashAttention's) and adds
each block's key/value gradients back into place.

Semantics are the band-masked reference's (`attention.sdpa_attention`): query i attends to keys
i - w + 1 .. i; w >= s is full causal attention; grouped-query attention (each key/value head
serves `heads / kv_heads` consecutive query heads) without repeating keys or values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd import Function

from megascale.model.eager_cache import eager_cache


def default_block(window: int) -> int:
    """Small blocks waste fewer pairs (s * block beyond the window's s * w), large ones make
    larger GEMMs: a quarter of the window, a power of two between 16 and 128."""
    return max(16, min(128, 1 << max(0, (window // 4).bit_length() - 1)))


@eager_cache(maxsize=16)
def _band_bias(window: int, block: int, previous: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[previous + 1, block, span]` (0 or -inf): entry i is the mask of query
    block i for i < previous (whose first keys are padding) and of every later block at i = previous."""
    span = (previous + 1) * block
    blocks = torch.arange(previous + 1, device=device).view(-1, 1, 1)
    q = blocks * block + torch.arange(block, device=device).view(1, -1, 1)
    k = (blocks - previous) * block + torch.arange(span, device=device).view(1, 1, -1)
    allowed = (k <= q) & (k > q - window) & (k >= 0)
    return torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _windows(x: torch.Tensor, span: int, block: int) -> torch.Tensor:
    """`[b, g, L, d]` padded keys/values -> `[b, g, n, span, d]`, block i's keys (a view)."""
    return x.unfold(2, span, block).transpose(-1, -2)


class _SlidingWindowAttention(Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, block: int) -> torch.Tensor:
        b, heads, s, d = q.shape
        groups = k.shape[1]
        per = heads // groups
        n = -(-s // block)
        previous = min(-(-(window - 1) // block), n - 1)
        span = (previous + 1) * block
        pad_end = n * block - s
        # queries: [b, groups, n, per * block, d], scaled; keys/values padded with `previous` blocks
        qb = F.pad(q * (1.0 / math.sqrt(d)), (0, 0, 0, pad_end)).view(b, groups, per, n, block, d)
        qb = qb.transpose(2, 3).reshape(b, groups, n, per * block, d)
        kp = F.pad(k, (0, 0, previous * block, pad_end))
        vp = F.pad(v, (0, 0, previous * block, pad_end))
        scores = qb @ _windows(kp, span, block).transpose(-1, -2)  # [b, groups, n, per*block, span]
        work = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
        bias = _band_bias(window, block, previous, q.device, work.dtype)
        masked = work.view(b, groups, n, per, block, span)
        # from block `previous` on, only the first span - w columns (the window's far edge) and
        # those after previous * block (the diagonal block's future) hold masked entries
        low, high = max(0, span - window), previous * block + 1
        masked[:, :, previous:, :, :, :low] += bias[previous, :, :low]
        masked[:, :, previous:, :, :, high:] += bias[previous, :, high:]
        masked[:, :, :previous] += bias[:previous].unsqueeze(1)
        # softmax numerators in place (one score-sized buffer); the division by the row sums is
        # applied to the [.., d] output, and in the backward to the [.., d] output gradient
        exp = work.sub_(work.amax(-1, keepdim=True)).exp_()
        sums = exp.sum(-1, keepdim=True)
        exp = exp.to(q.dtype)
        out = (exp @ _windows(vp, span, block)).div_(sums.to(q.dtype))  # [b, groups, n, per*block, d]
        ctx.save_for_backward(qb, kp, vp, exp, sums, out)
        ctx.shape = (b, heads, s, d, groups, per, n, block, span, previous)
        return _unblock(out, ctx.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qb, kp, vp, exp, sums, out = ctx.saved_tensors
        b, heads, s, d, groups, per, n, block, span, previous = ctx.shape
        go = F.pad(grad_out, (0, 0, 0, n * block - s)).view(b, groups, per, n, block, d)
        go = go.transpose(2, 3).reshape(b, groups, n, per * block, d).div(sums.to(grad_out.dtype))
        # with P = exp / sums: dS = P * (dP - rowsum(dP * P)), rowsum(dP * P) = rowsum(dO * O);
        # both terms divided by sums (in go) leave exp as the factor
        grad_scores = go @ _windows(vp, span, block).transpose(-1, -2)
        grad_scores = grad_scores.sub_((go * out).sum(-1, keepdim=True)).mul_(exp)
        grad_q = (grad_scores @ _windows(kp, span, block)) * (1.0 / math.sqrt(d))
        grad_kw = grad_scores.transpose(-1, -2) @ qb  # [b, groups, n, span, d]
        grad_vw = exp.transpose(-1, -2) @ go
        return (_unblock(grad_q, ctx.shape), _fold(grad_kw, ctx.shape), _fold(grad_vw, ctx.shape), None, None)


def _unblock(x: torch.Tensor, shape: tuple) -> torch.Tensor:
    """`[b, groups, n, per*block, d]` -> `[b, heads, s, d]`."""
    b, heads, s, d, groups, per, n, block, _, _ = shape
    x = x.view(b, groups, n, per, block, d).transpose(2, 3).reshape(b, heads, n * block, d)
    return x[:, :, :s]


def _fold(windows: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Gradients of every block's key window `[b, groups, n, span, d]` summed back into the
    keys `[b, groups, s, d]`: window offset j of block i is padded position (i + j) * block."""
    b, _, s, d, groups, _, n, block, _, previous = shape
    out = windows.new_zeros(b, groups, (n + previous) * block, d)
    for j in range(previous + 1):
        out[:, :, j * block:(j + n) * block] += windows[:, :, :, j * block:(j + 1) * block].reshape(b, groups, -1, d)
    return out[:, :, previous * block:previous * block + s]


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             block: int | None = None) -> torch.Tensor:
    """Causal attention of q `[b, heads, s, d]` over k, v `[b, kv_heads, s, d]` within the last
    `window` positions, in query blocks of `block` (default: `default_block(window)`)."""
    if window < 1:
        raise ValueError(f"model.window must be >= 1, got {window}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads")
    return _SlidingWindowAttention.apply(q, k, v, window, block or default_block(window))
