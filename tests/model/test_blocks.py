"""The two block kinds equal their formulas, computed by hand from the same weights."""

import pytest
import torch
import torch.nn.functional as F

from megascale.config import ModelConfig
from megascale.model import GPT, Block
from megascale.model.attention import band_mask


def _layer_norm(x, ln):
    return F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps)


def _attention_by_hand(x, attn, heads, window):
    b, s, h = x.shape
    d = h // heads
    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    qkv = qkv.view(b, s, heads, 3, d)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # [b, heads, s, d]
    scores = q @ k.transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(~band_mask(s, window, x.device), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
    return out @ attn.proj.weight.T + attn.proj.bias


def _mlp_by_hand(x, mlp):
    hidden = x @ mlp.fc.weight.T + mlp.fc.bias
    hidden = 0.5 * hidden * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (hidden + 0.044715 * hidden**3)))
    return hidden @ mlp.proj.weight.T + mlp.proj.bias


def _randomise(module):
    torch.manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


@pytest.mark.parametrize("window", [None, 5])
def test_parallel_block_equals_formula(window):
    cfg = ModelConfig(hidden=32, heads=4, block="parallel", positions="learned", window=window)
    block = Block(cfg).double()
    _randomise(block)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    h = _layer_norm(x, block.ln1)  # one LayerNorm feeds both branches
    expected = x + _mlp_by_hand(h, block.mlp) + _attention_by_hand(h, block.attn, 4, window)
    torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [None, 5])
def test_serial_block_equals_formula(window):
    cfg = ModelConfig(hidden=32, heads=4, block="serial", positions="learned", window=window)
    block = Block(cfg).double()
    _randomise(block)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    mid = x + _attention_by_hand(_layer_norm(x, block.ln1), block.attn, 4, window)
    expected = mid + _mlp_by_hand(_layer_norm(mid, block.ln2), block.mlp)
    torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)


def test_block_kinds_differ():
    """A test of the formulas above would pass for both if the kind were ignored."""
    torch.manual_seed(0)
    par = Block(ModelConfig(hidden=32, heads=4, block="parallel")).double()
    ser = Block(ModelConfig(hidden=32, heads=4, block="serial")).double()
    _randomise(par)
    _randomise(ser)
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    assert not torch.allclose(par(x), ser(x))


@pytest.mark.parametrize("positions", ["rotary", "learned"])
@pytest.mark.parametrize("tie", [False, True])
def test_gpt_loss_is_token_sum_and_parameter_count_matches(positions, tie):
    from megascale.model.flops import parameter_count

    cfg = ModelConfig(hidden=32, heads=4, layers=2, seq_len=16, positions=positions, tie_embeddings=tie)
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    labels = tokens.clone()
    labels[0, :4] = -100
    logits = model(tokens)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(model(tokens, labels), expected)
