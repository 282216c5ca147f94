"""The sliding-chunks kernel equals the band-masked SDPA reference and costs O(s*w)."""

import pytest
import torch

from megascale.config import ModelConfig
from megascale.diagnostics.tensor_memory import peak_tensor_bytes
from megascale.model import GPT, sliding_window
from megascale.model.attention import causal_attention, sdpa_attention
from megascale.model.efficiency import set_attention_kernel
from megascale.model.sliding_window import default_block, sliding_window_attention


def _qkv(seq, heads=4, kv_heads=2, dtype=torch.float64, dim=8):
    g = torch.Generator().manual_seed(seq)
    return [torch.randn(2, n, seq, dim, generator=g, dtype=dtype).requires_grad_() for n in (heads, kv_heads, kv_heads)]


def _with_grads(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)]


# (seq, window, block): windows inside a block, spanning several, multiples and not of the
# block, sequences not a multiple of the block, windows of 1, of s - 1, of s and beyond
CASES = [
    (64, 16, 16),
    (64, 17, 16),
    (100, 30, 16),
    (100, 1, 8),
    (37, 5, 16),
    (130, 64, 32),
    (50, 49, 16),
    (50, 50, 16),
    (50, 400, 16),
    (7, 3, 16),
    (96, 40, 128),
]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize(("seq", "window", "block"), CASES)
def test_values_and_gradients_equal_the_band_masked_reference(seq, window, block, fused, monkeypatch):
    """Both per-chunk kernels: the fused CPU flash kernel and the plain-PyTorch one of other devices."""
    monkeypatch.setattr(sliding_window, "_fused", lambda q: fused)
    q, k, v = _qkv(seq)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    want = _with_grads(lambda *a: sdpa_attention(*a, window), q, k, v, grad_out)
    got = _with_grads(lambda *a: sliding_window_attention(*a, window, block), q, k, v, grad_out)
    for name, g, e in zip(("out", "grad q", "grad k", "grad v"), got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("kv_heads", [1, 3, 6])
def test_grouped_query_attention_and_fp32(kv_heads, fused, monkeypatch):
    monkeypatch.setattr(sliding_window, "_fused", lambda q: fused)
    q, k, v = _qkv(75, heads=6, kv_heads=kv_heads, dtype=torch.float32)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    want = _with_grads(lambda *a: sdpa_attention(*a, 20), q, k, v, grad_out)
    got = _with_grads(lambda *a: sliding_window_attention(*a, 20), q, k, v, grad_out)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_auto_runs_the_sliding_kernel_off_cuda_for_windows_shorter_than_the_sequence():
    q, k, v = _qkv(40)
    assert "SlidingWindow" in type(causal_attention(q, k, v, 8).grad_fn).__name__
    assert "SlidingWindow" in type(causal_attention(q, k, v, 8, "sliding").grad_fn).__name__
    assert "SlidingWindow" not in type(causal_attention(q, k, v, 40).grad_fn).__name__  # full causal
    assert "SlidingWindow" not in type(causal_attention(q, k, v, 8, "sdpa").grad_fn).__name__
    with pytest.raises(ValueError, match="model.window must be >= 1"):
        sliding_window_attention(q, k, v, 0)


@pytest.mark.slow  # long sequences
def test_memory_grows_linearly_with_the_sequence(monkeypatch):
    """Forward + backward peak memory at a fixed window: doubling the sequence doubles it, and
    it stays within 1.5x of fused full causal attention's (output, log-sum-exp and gradients;
    the probabilities are never all alive, one chunk group's at a time). Groups of 2-3 chunks
    here, so that one group's key windows (a constant, 16 MiB by default) stay small."""
    monkeypatch.setattr(sliding_window, "GROUP_KEY_BYTES", 64 << 10)
    window, peaks = 64, {}
    for seq in (1024, 2048):
        q, k, v = _qkv(seq, heads=2, kv_heads=2, dtype=torch.float32, dim=16)
        for w in (window, None):
            peaks[seq, w] = peak_tensor_bytes(
                lambda q=q, k=k, v=v, w=w: causal_attention(q, k, v, w).sum().backward(), external=(q, k, v)
            )
        assert peaks[seq, window] < 1.5 * peaks[seq, None], peaks
    assert peaks[2048, window] / peaks[1024, window] < 2.1, peaks


def test_default_block():
    assert [default_block(w) for w in (1, 64, 100, 512, 4096)] == [16, 16, 16, 128, 128]


def test_a_windowed_model_trains_the_same_with_the_sliding_kernel_and_the_reference():
    cfg = ModelConfig(vocab_size=64, seq_len=48, layers=2, hidden=32, heads=4, kv_heads=2, window=12)
    tokens = torch.randint(0, 64, (4, 48), generator=torch.Generator().manual_seed(0))
    losses = {}
    for kernel in ("sliding", "sdpa"):
        model = GPT(cfg, seed=0)
        set_attention_kernel(model, kernel)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[kernel] = []
        for _ in range(6):
            loss = model(tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[kernel].append(loss.item())
    assert losses["sliding"] == pytest.approx(losses["sdpa"], rel=1e-5)
    assert losses["sliding"][-1] < losses["sliding"][0] - 0.3


@pytest.mark.parametrize(
    ("prefix", "seq", "window", "block"), [(16, 40, 16, 16), (5, 37, 9, 8), (40, 24, 12, 8), (3, 20, 30, 16)]
)
def test_keys_with_a_prefix_are_the_last_queries_of_the_longer_sequence(prefix, seq, window, block):
    """Context parallelism's halo: queries of positions prefix.. over keys from 0 equal the tail of
    attention over the whole sequence, and the prefix keys get the tail queries' gradients."""
    q, k, v = _qkv(prefix + seq)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    grad_out[:, :, :prefix] = 0
    want = _with_grads(lambda *a: sdpa_attention(*a, window), q, k, v, grad_out)
    tail = q.detach()[:, :, prefix:].requires_grad_()
    got = _with_grads(lambda *a: sliding_window_attention(*a, window, block), tail, k, v, grad_out[:, :, prefix:])
    want[0], want[1] = want[0][:, :, prefix:], want[1][:, :, prefix:]
    for name, g, e in zip(("out", "grad q", "grad k", "grad v"), got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
