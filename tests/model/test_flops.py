"""FLOPs accounting: the real attention span, SWA and the parallel block counted right."""

import pytest

from megascale.config import ModelConfig
from megascale.model.flops import flops_per_token, mean_attention_span


def test_mean_span_counts_the_real_causal_and_window_span():
    assert mean_attention_span(4, None) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert mean_attention_span(6, 2) == pytest.approx((1 + 2 + 2 + 2 + 2 + 2) / 6)
    assert mean_attention_span(6, 100) == mean_attention_span(6, None)


def test_flops_per_token_by_hand():
    cfg = ModelConfig(vocab_size=10, seq_len=4, layers=2, hidden=8, heads=2, ffn_hidden=16, window=2)
    f = flops_per_token(cfg)
    dense = 2 * 2 * (4 * 8 * 8 + 2 * 8 * 16)
    span = (1 + 2 + 2 + 2) / 4
    attention = 2 * 4 * span * 8
    head = 2 * 8 * 10
    assert f.dense == dense and f.attention == pytest.approx(attention) and f.head == head
    assert f.training == pytest.approx(3 * (dense + attention + head))


def test_swa_and_parallel_block_flops():
    full = flops_per_token(ModelConfig(seq_len=2048, window=None))
    swa = flops_per_token(ModelConfig(seq_len=2048, window=256))
    assert swa.attention < full.attention / 4 and swa.dense == full.dense
    serial = flops_per_token(ModelConfig(block="serial"))
    assert serial.forward == flops_per_token(ModelConfig(block="parallel")).forward
