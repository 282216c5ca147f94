"""Speed-only transformations leave the loss and every gradient unchanged."""

import copy

import pytest
import torch

from megascale.config import ModelConfig
from megascale.model import GPT
from megascale.model.efficiency import apply_recompute, fuse_parallel_gemms


def _loss_and_grads(model, tokens):
    model.zero_grad()
    loss = model(tokens, tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pair(block="parallel"):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden=32, heads=4, layers=2, seq_len=16, block=block, window=6)
    base = GPT(cfg)
    return base, copy.deepcopy(base), torch.randint(0, cfg.vocab_size, (2, 16))


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("block", ["serial", "parallel"])
def test_recompute_keeps_gradients_and_names(mode, block):
    base, other, tokens = _pair(block)
    names = [n for n, _ in other.named_parameters()]
    apply_recompute(other.blocks, mode)
    assert [n for n, _ in other.named_parameters()] == names
    loss_a, grads_a = _loss_and_grads(base, tokens)
    loss_b, grads_b = _loss_and_grads(other, tokens)
    torch.testing.assert_close(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7)


def test_fused_gemms_match_four_gemms():
    base, other, tokens = _pair("parallel")
    fuse_parallel_gemms(other.blocks)
    widths = []  # output widths of the GEMMs each block's input and output layers run
    for block in other.blocks:
        for layer in (block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.proj):
            layer.project = (lambda f: lambda x, w, b: widths.append(tuple(w.shape)) or f(x, w, b))(layer.project)
    loss_a, grads_a = _loss_and_grads(base, tokens)
    loss_b, grads_b = _loss_and_grads(other, tokens)
    h, ffn = 32, 128
    assert widths == [(3 * h + ffn, h), (h, h + ffn)] * 2  # one GEMM in, one out, per block
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)


def test_recompute_rejects_unknown_mode():
    base, _, _ = _pair()
    with pytest.raises(ValueError, match="train.recompute"):
        apply_recompute(base.blocks, "sometimes")


def test_attention_kernel_choice_reaches_every_layer():
    from megascale.model import Attention
    from megascale.model.efficiency import set_attention_kernel

    base, _, _ = _pair()
    set_attention_kernel(base, "sdpa")
    kernels = {m.kernel for m in base.modules() if isinstance(m, Attention)}
    assert kernels == {"sdpa"}
