"""Sliding-window attention equals attention under an explicit band mask."""

import warnings

import pytest
import torch

from megascale.model.attention import causal_attention, flex_attention, sdpa_attention


def _explicit(q, k, v, window):
    s = q.shape[-2]
    i = torch.arange(s).unsqueeze(1)
    j = torch.arange(s).unsqueeze(0)
    allowed = (j <= i) & ((j > i - window) if window else torch.ones_like(j <= i))
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def _qkv(seq=24, dtype=torch.float64, heads=3, kv_heads=3):
    torch.manual_seed(3)
    return [torch.randn(2, n, seq, 8, dtype=dtype) for n in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("window", [1, 2, 5, 16, 23])
def test_sliding_window_equals_band_mask(window):
    q, k, v = _qkv()
    torch.testing.assert_close(sdpa_attention(q, k, v, window), _explicit(q, k, v, window))


@pytest.mark.parametrize("window", [24, 25, 1000])
def test_window_at_least_sequence_equals_full_causal(window):
    q, k, v = _qkv()
    torch.testing.assert_close(sdpa_attention(q, k, v, window), sdpa_attention(q, k, v, None))
    torch.testing.assert_close(sdpa_attention(q, k, v, None), _explicit(q, k, v, None))


@pytest.mark.parametrize("window", [None, 5])
def test_grouped_query_attention_repeats_each_key_value_head_for_its_queries(window):
    """Query heads 0-2 use key/value head 0, heads 3-5 head 1 (the group-major QKV layout)."""
    q, k, v = _qkv(heads=6, kv_heads=2)
    repeated = [t.repeat_interleave(3, dim=1) for t in (k, v)]
    torch.testing.assert_close(sdpa_attention(q, k, v, window), _explicit(q, *repeated, window))
    torch.testing.assert_close(causal_attention(q, k, v, window), _explicit(q, *repeated, window))


def test_window_changes_result():
    q, k, v = _qkv()
    assert not torch.allclose(sdpa_attention(q, k, v, 4), sdpa_attention(q, k, v, None))


@pytest.mark.slow
def test_flex_attention_matches_sdpa_on_cpu(cpu_compiler):
    """FlexAttention's block mask (the GPU kernel that skips masked blocks) gives the same
    values; on CPU it runs compiled (~25-50 s a case on 2 cores), so one small case: the windowed
    one with grouped-query attention (4 query heads on 2 key/value heads). The unwindowed and
    a 256-token window are compared to SDPA by the GPU script's dry run
    (`tests/model/test_gpu_bench.py`, `flex_vs_sdpa_window_*`)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    window = 64
    q, k, v = _qkv(seq=256, dtype=torch.float32, heads=4, kv_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, window)
    torch.testing.assert_close(out, sdpa_attention(q, k, v, window), rtol=1e-4, atol=1e-5)


def test_dispatch_on_cpu_equals_sdpa():
    q, k, v = _qkv()
    for window in (None, 5, 24):
        torch.testing.assert_close(causal_attention(q, k, v, window), sdpa_attention(q, k, v, window))


@pytest.mark.slow
def test_flex_inside_a_compiled_block_is_one_graph_and_matches_sdpa(cpu_compiler):
    """How a compiled block runs SWA on a GPU: FlexAttention and its block mask traced into the
    block's graph (no graph break, no Dynamo cache warnings), with the eager SDPA result."""
    from megascale.config import ModelConfig
    from megascale.model import GPT
    from megascale.model.efficiency import set_attention_kernel

    cfg = ModelConfig(vocab_size=64, seq_len=128, layers=1, hidden=64, heads=4, window=32)
    block = GPT(cfg, seed=0).blocks[0]
    x = torch.randn(2, 128, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # FlexAttention has no CPU backward
        want = block(x)
        set_attention_kernel(block, "flex")
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            explained = torch._dynamo.explain(block)(x)
            got = torch.compile(block, dynamic=False)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
