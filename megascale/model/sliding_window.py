"""Sliding-window attention that costs O(s*w) time and O(s*d) memory on any device.

A band mask through SDPA computes all s*s scores and throws most away: on CPU a window makes
attention slower than full causal attention. Here the queries are cut into chunks of `block`
positions; a chunk attends only to its own keys and the `w - 1` before them, under a band mask
`[block, block + w - 1]`, so the whole costs s * (w + block) pairs instead of s^2 / 2.

Each chunk is one call of an attention kernel that returns the output and the log-sum-exp of
every query, as FlashAttention does; the backward calls the matching backward kernel per chunk,
which recomputes the chunk's probabilities from the log-sum-exp. So only one chunk's scores are
alive at once: memory is the inputs' size, as fused full attention's. On CPU the kernel is
PyTorch's fused flash-attention kernel (`_scaled_dot_product_flash_attention_for_cpu`: its
softmax never leaves the cache); elsewhere `_eager_forward`/`_eager_backward`, plain PyTorch.

Semantics are the band-masked reference's (`attention.sdpa_attention`): query i attends to keys
i - w + 1 .. i; grouped-query attention (each key/value head serves `heads / kv_heads`
consecutive query heads) without repeating keys or values. Keys and values may be longer than
the queries by a prefix (context parallelism's halo, `parallel/context.py`): query i then sits
at key position i + prefix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd import Function

from megascale.model.eager_cache import eager_cache


def default_block(window: int) -> int:
    """Small chunks waste fewer pairs (s * block beyond the window's s * w), large ones make
    fewer, larger kernel calls: a quarter of the window, a power of two between 16 and 128."""
    return max(16, min(128, 1 << max(0, (window // 4).bit_length() - 1)))


@eager_cache(maxsize=16)
def _band(window: int, queries: int, keys: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[queries, keys]` (0 or -inf): query r sits at key column r + keys - queries
    and sees the `window` columns up to it."""
    q = torch.arange(queries, device=device).view(-1, 1) + keys - queries
    k = torch.arange(keys, device=device).view(1, -1)
    allowed = (k <= q) & (k > q - window)
    return torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Softmax arithmetic in fp32 at least (fp64 stays fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _eager_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's contract in plain PyTorch: (output, log-sum-exp `[b, heads, queries]`)."""
    per = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(per, 1), v.repeat_interleave(per, 1)
    scores = _wide(q @ k.transpose(-1, -2)).mul_(scale).add_(mask)
    lse = scores.logsumexp(-1)
    return (scores.sub_(lse.unsqueeze(-1)).exp_().to(q.dtype) @ v), lse


def _eager_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    per = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(per, 1), v.repeat_interleave(per, 1)
    probs = _wide(q @ kr.transpose(-1, -2)).mul_(scale).add_(mask).sub_(lse.unsqueeze(-1)).exp_()
    # softmax backward: dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O)
    delta = _wide((grad_out * out).sum(-1, keepdim=True))
    grad_s = _wide(grad_out @ vr.transpose(-1, -2)).sub_(delta).mul_(probs).to(q.dtype)
    grad_q = (grad_s @ kr) * scale
    grad_k = (grad_s.transpose(-1, -2) @ q) * scale
    grad_v = probs.to(q.dtype).transpose(-1, -2) @ grad_out

    def fold(x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], k.shape[1], per, *x.shape[2:]).sum(2)

    return grad_q, fold(grad_k), fold(grad_v)


def _eager_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    if causal:
        return _band(k.shape[2], q.shape[2], k.shape[2], q.device, q.dtype)
    return q.new_zeros(()) if mask is None else mask


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of attention with FlashAttention's contract: (output, log-sum-exp `[b, heads, queries]`),
    under an additive `mask`, or causal (square blocks), or neither. On CPU the fused flash kernel,
    elsewhere plain PyTorch. The sliding-chunks kernel and ring attention (`parallel/ring.py`) call it."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    return _eager_forward(q, k, v, _eager_mask(q, k, mask, causal), scale)


def attention_with_lse_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Gradients of q, k, v of one block, its probabilities recomputed from `lse`. Given the output
    and log-sum-exp of the whole row (over every block of keys), this block's share of the
    gradients is exact: how ring attention's backward adds blocks up."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    return _eager_backward(grad_out, q, k, v, out, lse, _eager_mask(q, k, mask, causal), scale)


GROUP_KEY_BYTES = 16 << 20  # key + value windows of one group of chunks (one kernel call)


class _Chunks:
    """Where chunk c's queries and keys lie: queries [c * block, +block), keys from `window - 1`
    positions before its first query (zeros, masked, before the first key). Chunks go to the
    kernel in groups, stacked along the batch: the interior chunks (all of one shape, one band
    mask) as many at a time as fit `GROUP_KEY_BYTES`, so the kernel is called s / block / group
    times, not s / block (each call is a parallel region: many small ones cost much on a loaded
    machine); the first chunks (padding in front) and a short last chunk alone."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, window: int, block: int):
        self.s, self.keys, self.window, self.block = q.shape[2], k.shape[2], window, block
        self.prefix = self.keys - self.s
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        span = block + window - 1
        self.group = max(1, GROUP_KEY_BYTES // (2 * k.shape[0] * k.shape[1] * span * k.shape[3] * k.element_size()))

    def __iter__(self):
        """(first query, chunks) of every group."""
        start = 0
        while start < self.s:
            lo, _ = self.key_range(start)
            if lo < 0 or start + self.block > self.s:
                count = 1
            else:
                count = max(1, min(self.group, (self.s - start) // self.block))
            yield start, count
            start += count * self.block

    def key_range(self, start: int, count: int = 1) -> tuple[int, int]:
        """Keys of the chunks from query `start`, in k's positions (the first may be < 0)."""
        stop = min(start + count * self.block, self.s) + self.prefix
        return start + self.prefix - (self.window - 1), stop

    def rows(self, x: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Queries (or outputs) of a group `[b, heads, s, e]` -> `[b * count, heads, block, e]`."""
        if count == 1:
            return x[:, :, start : start + self.block]
        b, h, _, e = x.shape
        part = x[:, :, start : start + count * self.block].view(b, h, count, self.block, e)
        return part.transpose(1, 2).reshape(b * count, h, self.block, e)

    def put(self, dst: torch.Tensor, start: int, count: int, value: torch.Tensor) -> None:
        b, h, _, e = dst.shape
        value = value.view(b, count, h, -1, e).transpose(1, 2).reshape(b, h, -1, e)
        dst[:, :, start : start + value.shape[2]] = value

    def kv(self, x: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Keys (or values) of a group: `[b * count, kv_heads, keys of a chunk, d]`."""
        lo, hi = self.key_range(start, count)
        if lo < 0:
            return F.pad(x[:, :, 0:hi], (0, 0, -lo, 0))
        if count == 1:
            return x[:, :, lo:hi]
        b, g, _, d = x.shape
        windows = x[:, :, lo:hi].unfold(2, self.block + self.window - 1, self.block)  # [b, g, count, d, span]
        return windows.permute(0, 2, 1, 4, 3).reshape(b * count, g, -1, d)

    def fold(self, dst: torch.Tensor, start: int, count: int, grad: torch.Tensor) -> None:
        """Add a group's key (or value) gradients `[b * count, kv_heads, span, d]` into place."""
        lo, hi = self.key_range(start, count)
        if count == 1:
            dst[:, :, max(lo, 0) : hi] += grad[:, :, max(0, -lo) :]
            return
        b, g, _, d = dst.shape
        grad = grad.view(b, count, g, -1, d).transpose(1, 2)  # [b, g, count, span, d]
        span, rows = grad.shape[3], count * self.block
        for offset in range(0, span, self.block):  # window piece `offset` of every chunk
            width = min(self.block, span - offset)
            first = lo + offset
            if first + rows <= dst.shape[2]:
                target = dst[:, :, first : first + rows].view(b, g, count, self.block, d)
                target[:, :, :, :width] += grad[:, :, :, offset : offset + width]
            else:  # the last piece ends the keys: the last chunk's part of it is shorter than a block
                target = dst[:, :, first : first + rows - self.block].view(b, g, count - 1, self.block, d)
                target[:, :, :, :width] += grad[:, :, :-1, offset : offset + width]
                last = first + rows - self.block
                dst[:, :, last : last + width] += grad[:, :, -1, offset : offset + width]

    def mask(self, start: int, like: torch.Tensor) -> torch.Tensor:
        lo, hi = self.key_range(start)
        queries = min(start + self.block, self.s) - start
        band = _band(self.window, queries, hi - lo, like.device, like.dtype)
        if lo < 0:
            band = band.clone()
            band[:, :-lo] = float("-inf")
        return band


class _SlidingWindowAttention(Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, block: int) -> torch.Tensor:
        chunks = _Chunks(q, k, window, block)
        out = q.new_empty(q.shape)
        lse = q.new_empty(*q.shape[:3], 1, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        for start, count in chunks:
            args = (chunks.rows(q, start, count), chunks.kv(k, start, count), chunks.kv(v, start, count))
            o, m = attention_with_lse(*args, chunks.mask(start, q), chunks.scale)
            chunks.put(out, start, count, o)
            chunks.put(lse, start, count, m.unsqueeze(-1))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks = chunks
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        chunks: _Chunks = ctx.chunks
        grad_q = torch.empty_like(q)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        for start, count in chunks:
            args = (
                chunks.rows(grad_out, start, count),
                chunks.rows(q, start, count),
                chunks.kv(k, start, count),
                chunks.kv(v, start, count),
                chunks.rows(out, start, count),
                chunks.rows(lse, start, count).squeeze(-1),
            )
            dq, dk, dv = attention_with_lse_backward(*args, chunks.mask(start, q), chunks.scale)
            chunks.put(grad_q, start, count, dq)
            chunks.fold(grad_k, start, count, dk)
            chunks.fold(grad_v, start, count, dv)
        return grad_q, grad_k, grad_v, None, None


def sliding_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, block: int | None = None
) -> torch.Tensor:
    """Causal attention of q `[b, heads, s, d]` over k, v `[b, kv_heads, prefix + s, d]` within the
    last `window` positions, in query chunks of `block` (default: `default_block(window)`)."""
    if window < 1:
        raise ValueError(f"model.window must be >= 1, got {window}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads")
    if k.shape[2] < q.shape[2] or v.shape[2] != k.shape[2]:
        raise ValueError(
            f"keys/values of {k.shape[2]}/{v.shape[2]} positions for {q.shape[2]} queries: "
            "they must be equal, and at least as many as the queries"
        )
    return _SlidingWindowAttention.apply(q, k, v, window, block or default_block(window))
