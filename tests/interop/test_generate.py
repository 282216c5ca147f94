"""`generate` with a key/value cache: the same tokens as running the whole context for every new
token (greedy and sampled; full, sliding-window and grouped-query attention; rotary and learned
positions, past the learned positions' context), and a cost linear in the generated length: the
tokens that go through the model are counted."""

from __future__ import annotations

import pytest
import torch

from megascale.config import ModelConfig
from megascale.interop.generate import generate, last_logits
from megascale.model import GPT
from megascale.model.attention import KVCache

MODELS = {
    "serial-llama-gqa": ModelConfig(
        vocab_size=64,
        seq_len=64,
        layers=2,
        hidden=32,
        heads=4,
        kv_heads=2,
        block="serial",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
    ),
    "parallel-swa": ModelConfig(vocab_size=64, seq_len=64, layers=2, hidden=32, heads=4, window=6),
    "learned-positions": ModelConfig(
        vocab_size=64,
        seq_len=24,
        layers=2,
        hidden=32,
        heads=4,
        block="serial",
        positions="learned",
        norm="layernorm",
        mlp="gelu",
        bias=True,
    ),
}


def _counted(model: GPT) -> list[int]:
    """Tokens through the model so far (one entry per forward)."""
    seen: list[int] = []
    model.embed.tokens.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    return seen


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_generation_equals_full_recompute(name: str, temperature: float) -> None:
    model = GPT(MODELS[name], seed=3).eval()
    with torch.no_grad():  # sharper logits than the initialisation's, so greedy ties are unlikely
        model.head.out.weight.mul_(20)
    prompt = [5, 9, 2, 33, 7]
    new = 30 if name != "learned-positions" else 40  # 45 > seq_len 24: the window slides
    full = generate(model, prompt, new, temperature, top_k=8, seed=1, cache=False)
    assert generate(model, prompt, new, temperature, top_k=8, seed=1) == full
    assert len(full) == new


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_token_at_a_time_through_the_cache_gives_the_full_forwards_logits(name: str) -> None:
    model = GPT(MODELS[name], seed=4).eval()
    tokens = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)[0]
        for block in model.blocks:
            block.attn.cache = KVCache(block.attn.window)
        got = [last_logits(model, tokens[:, :6], 0)]
        got += [last_logits(model, tokens[:, i : i + 1], i) for i in range(6, 20)]
    torch.testing.assert_close(torch.stack(got), want[5:], rtol=0, atol=1e-5)


def test_cost_is_linear_in_the_generated_length() -> None:
    model = GPT(MODELS["serial-llama-gqa"], seed=0).eval()
    seen = _counted(model)
    prompt, new = [1, 2, 3, 4], 40
    generate(model, prompt, new)
    assert seen == [len(prompt)] + [1] * (new - 1)
    seen.clear()
    generate(model, prompt, new, cache=False)
    assert sum(seen) == sum(len(prompt) + i for i in range(new))  # quadratic without the cache
