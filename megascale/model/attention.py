"""Causal self-attention, full or sliding-window, on whatever kernel the hardware has.

Sliding-window attention (SWA): query i attends to keys i-w+1..i, at a cost of O(s*w) on every
device: on CUDA FlexAttention's block mask skips the blocks outside the band; everywhere else
the sliding-chunks kernel (`sliding_window.py`, plain PyTorch, forward and backward) computes
only each query block's window. SDPA with a dense band mask is the reference (O(s^2): slower
than full causal attention). The choice of kernel never changes the result (tests check
parity), only the speed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megascale.model.eager_cache import eager_cache
from megascale.model.sliding_window import sliding_window_attention


@eager_cache(maxsize=16)
def band_mask(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [s, s] mask, True where query i may attend key j (causal, within the window)."""
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return allowed


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim], where each key/value
    head serves `heads / kv_heads` consecutive query heads (grouped-query attention)."""
    seq_len, gqa = q.shape[-2], k.shape[1] != q.shape[1]
    if window is None or window >= seq_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(seq_len, window, q.device), enable_gqa=gqa)


@eager_cache(maxsize=16)
def _block_mask(seq_len: int, window: int | None, device: str):  # pragma: no cover - GPU
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_causal(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        if window is None:
            return causal
        return causal & (q_idx - kv_idx < window)

    return create_block_mask(sliding_causal, None, None, seq_len, seq_len, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():  # pragma: no cover - GPU
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """FlexAttention with a sliding-window block mask: masked blocks are skipped, not computed.

    Eagerly: a compiled kernel and a cached mask. Inside a compiled block both are traced into
    the block's graph instead (Dynamo would ignore the compiled wrapper, and warn).

    q, k, v are made contiguous first. The compiled kernel has given silently wrong results
    for other layouts: here, on CPU, a rotary output with the permuted layout of the QKV split
    (test_attention.py); upstream, garbage K gradients (pytorch#146377)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    gqa = k.shape[1] != q.shape[1]
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention as flex

        return flex(q, k, v, block_mask=_block_mask(q.shape[-2], window, str(q.device)), enable_gqa=gqa)
    return _compiled_flex()(q, k, v, block_mask=_block_mask(q.shape[-2], window, str(q.device)), enable_gqa=gqa)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, kernel: str = "auto"
) -> torch.Tensor:
    """Dispatch to a kernel. `auto`: SDPA (FlashAttention on GPU) for full causal attention and
    for windows as long as the sequence; for SWA, FlexAttention on CUDA and the sliding-chunks
    kernel elsewhere. `sliding`: that kernel on any device. `sdpa`: SDPA, band-masked for SWA."""
    if kernel == "flex" or (kernel == "auto" and window is not None and q.is_cuda):
        return flex_attention(q, k, v, window)
    if kernel in ("auto", "sliding") and window is not None and window < q.shape[-2]:
        return sliding_window_attention(q, k, v, window)
    return sdpa_attention(q, k, v, window)


class KVCache:
    """One layer's keys and values of the tokens seen so far, for generation: the prompt goes in
    once (causal attention), then each new token attends to the cached keys. A sliding window
    keeps only its last `window` keys, which is all a new token may see."""

    def __init__(self, window: int | None):
        self.window = window
        self.seen = 0  # positions passed through, whatever the window kept
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> torch.Tensor:
        """Like `causal_attention` for q, k, v of the positions after `seen`."""
        if self.k is None:
            out = causal_attention(q, k, v, self.window, kernel)
        else:
            if q.shape[-2] != 1:
                raise ValueError("a KV cache takes the prompt once, then one token at a time")
            k, v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
            if self.window is not None:
                k, v = k[..., -self.window :, :], v[..., -self.window :, :]
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
        self.seen += q.shape[-2]
        self.k, self.v = (k, v) if self.window is None else (k[..., -self.window :, :], v[..., -self.window :, :])
        return out
