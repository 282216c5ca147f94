"""The chunked head and loss equal the plain projection + cross-entropy, without whole logits."""

import pytest
import torch
import torch.nn.functional as F

from megascale.config import ModelConfig
from megascale.diagnostics.tensor_memory import peak_tensor_bytes
from megascale.model import GPT, IGNORE_INDEX
from megascale.model.efficiency import set_loss_chunk
from megascale.model.loss import chunked_cross_entropy

TOKENS, HIDDEN, VOCAB = 50, 16, 97


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels[::6] = IGNORE_INDEX
    return x, w, labels


def _plain(x, w, labels):
    return F.cross_entropy(F.linear(x, w).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _value_and_grads(loss_fn, x, w, labels, scale=1.0):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = loss_fn(x, w, labels)
    (loss * scale).backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 16, TOKENS, 1000])
def test_chunked_equals_plain_fp32(chunk):
    x, w, labels = _inputs()
    want = _value_and_grads(_plain, x, w, labels, scale=0.37)  # the backward scales by its input
    got = _value_and_grads(lambda *a: chunked_cross_entropy(*a, chunk), x, w, labels, scale=0.37)
    for g, e, name in zip(got, want, ("loss", "grad x", "grad weight"), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_chunked_equals_plain_under_bf16_autocast_and_bf16_weights():
    x, w, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _value_and_grads(_plain, x, w, labels)
        got = _value_and_grads(lambda *a: chunked_cross_entropy(*a, 8), x, w, labels)
    assert got[1].dtype == got[2].dtype == torch.float32  # fp32 leaves get fp32 gradients
    bf16 = [
        _value_and_grads(fn, *_inputs(torch.bfloat16)[:2], labels)
        for fn in (_plain, lambda *a: chunked_cross_entropy(*a, 8))
    ]
    assert bf16[1][2].dtype == torch.bfloat16
    for g, e in (got, want), (bf16[1], bf16[0]):
        for a, b in zip(g, e, strict=True):  # bf16 GEMMs: a few ulps of bf16 of the tensor's scale
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_no_grad_and_ignored_tokens():
    x, w, labels = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(x, w, labels, 9), _plain(x, w, labels))
    ignored = torch.full_like(labels, IGNORE_INDEX)
    loss = chunked_cross_entropy(x, w, ignored, 9)
    loss.backward()
    assert loss.item() == 0 and not x.grad.any() and not w.grad.any()
    with pytest.raises(ValueError, match="train.loss_chunk must be >= 1"):
        chunked_cross_entropy(x, w, labels, 0)


def test_gpt_loss_and_gradients_equal_the_whole_logits_loss():
    cfg = ModelConfig(vocab_size=VOCAB, seq_len=24, layers=1, hidden=32, heads=4, tie_embeddings=True)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, 1)
    model = GPT(cfg, seed=0)
    plain = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten(), reduction="sum")
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    set_loss_chunk(model, 5)
    assert model.head.loss_chunk == 5
    loss = model(tokens, labels)
    loss.backward()
    torch.testing.assert_close(loss, plain)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_whole_logits_never_exist_forward_or_backward():
    """Peak memory of the head's forward + backward at vocabulary 16k over 1024 tokens: whole fp32
    logits are 64 MiB (the plain path holds about three such tensors at once); in 64-token chunks
    the peak is a chunk's logits, a few of their temporaries and the weight's gradient."""
    cfg = ModelConfig(vocab_size=16384, seq_len=512, layers=1, hidden=32, heads=2)
    model = GPT(cfg, seed=0)
    set_loss_chunk(model, 64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 512), generator=torch.Generator().manual_seed(0))
    h = model.hidden_states(tokens).detach().requires_grad_()
    logits_bytes = tokens.numel() * cfg.vocab_size * 4
    peak = peak_tensor_bytes(lambda: model.head(h, tokens).backward())
    assert peak < 0.25 * logits_bytes, f"peak {peak / 2**20:.1f} MiB, whole logits {logits_bytes / 2**20:.0f} MiB"
