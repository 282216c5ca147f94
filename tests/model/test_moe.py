"""The MoE layer on one process: what it computes per token, what it drops, the auxiliary
losses it adds to the gradients, the balancing bias, and the counts MFU divides by."""

from __future__ import annotations

import pytest
import torch

from megascale.config import ConfigError
from megascale.config.schema import ModelConfig, MoEConfig
from megascale.model import GPT
from megascale.model.flops import flops_per_token, parameter_count
from megascale.model.moe import MoE, balance_step, moe_layers


def _cfg(**moe) -> ModelConfig:
    cfg = ModelConfig(
        vocab_size=32,
        seq_len=8,
        layers=2,
        hidden=16,
        heads=2,
        ffn_hidden=24,
        mlp="swiglu",
        bias=False,
        norm="rmsnorm",
        moe=MoEConfig(**{"experts": 4, "ffn_hidden": 12, **moe}),
    )
    cfg.validate()
    return cfg


def _layer(**moe) -> MoE:
    torch.manual_seed(0)
    layer = moe_layers(GPT(_cfg(**moe), seed=3))[0]
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its top-k experts of gate * expert(x), plus the shared expert."""
    rows = []
    for t in x.reshape(-1, x.shape[-1]):
        logits = layer.router(t).float()
        scores = logits.softmax(-1) if layer.kind == "softmax" else logits.sigmoid()
        top = scores.topk(layer.top_k).indices
        gates = scores[top] / (scores[top].sum() if layer.normalize or layer.kind == "sigmoid" else 1.0)
        row = sum(g * layer.experts[str(int(e))](t) for g, e in zip(gates, top, strict=True))
        shared = layer.shared(t) if layer.shared is not None else 0
        if layer.shared_gate is not None:
            shared = shared * torch.sigmoid(layer.shared_gate.weight[0] @ t)
        rows.append(row + shared)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize(
    "moe",
    [
        dict(top_k=2),
        dict(top_k=2, router="sigmoid", shared_ffn_hidden=8),
        dict(top_k=3, normalize=False),
        dict(top_k=2, normalize=False, shared_ffn_hidden=8, shared_gate=True),  # Qwen2-MoE
    ],
)
def test_moe_layer_is_the_gated_sum_of_each_tokens_top_k_experts(moe):
    layer = _layer(**moe)
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-6)


def test_capacity_keeps_the_first_tokens_of_a_sequence_and_counts_the_rest():
    layer = _layer(top_k=1, bias_balancing=True, capacity_factor=1.0)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([1e3, 0.0, 0.0, 0.0]))  # every token wants expert 0
    x = torch.randn(2, 8, 16)
    out = layer(x)
    capacity = 2  # ceil(1.0 * 8 tokens * top-1 / 4 experts)
    assert out[:, capacity:].abs().max() == 0  # dropped: the residual carries them
    assert out[:, :capacity].abs().min() > 0
    stats = balance_step([layer], lambda s: s)
    assert stats["moe_dropped"] == pytest.approx(12 / 16) and stats["moe_load"] == [16, 0, 0, 0]


def _aux_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per sequence: tokens * E * sum_i f_i P_i (Switch), plus the z-loss's token sum."""
    total = torch.zeros(())
    for seq in x:
        logits = layer.router(seq).float()
        probs = logits.softmax(-1)
        chosen = probs.topk(layer.top_k).indices
        f = torch.bincount(chosen.flatten(), minlength=layer.num_experts).float() / (seq.shape[0] * layer.top_k)
        total = total + layer.aux_coef * seq.shape[0] * layer.num_experts * (f * probs.mean(0)).sum()
        total = total + layer.z_coef * logits.logsumexp(-1).square().sum()
    return total


def test_balancing_and_z_losses_reach_the_gradients_scaled_like_the_loss():
    layer = _layer(top_k=2, aux_loss_coef=0.5, z_loss_coef=0.1)
    x, target = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    layer.aux_scale = 0.25
    (layer(x) * target).sum().backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.aux_coef = layer.z_coef = 0.0  # the plain output, then the reference auxiliary losses
    plain = (layer(x) * target).sum()
    layer.aux_coef, layer.z_coef = 0.5, 0.1
    (plain + 0.25 * _aux_reference(layer, x)).backward()
    torch.testing.assert_close(got, layer.router.weight.grad, rtol=1e-5, atol=1e-7)


def test_a_batch_in_one_forward_or_in_micro_batches_gives_the_same_gradients():
    """Statistics are per sequence: how the batch is split (micro-batches, dp ranks) cannot matter."""
    cfg = _cfg(top_k=2, capacity_factor=1.0, shared_ffn_hidden=8)
    tokens, labels = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    grads = []
    for parts in (1, 2):
        model = GPT(cfg, seed=5)
        for x, y in zip(tokens.chunk(parts), labels.chunk(parts), strict=True):
            model(x, y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bias_balancing_moves_each_bias_towards_the_mean_load():
    layer = _layer(top_k=1, bias_balancing=True, bias_update_rate=0.01)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([1e3, 0.0, 0.0, 0.0]))
    layer(torch.randn(2, 8, 16))
    stats = balance_step([layer], lambda s: s)
    assert stats["moe_imbalance"] == pytest.approx(4.0)  # every token on one of 4 experts
    torch.testing.assert_close(layer.expert_bias, torch.tensor([1e3 - 0.01, 0.01, 0.01, 0.01]))
    assert layer.load is None  # counters reset for the next step


def test_parameter_count_and_flops_count_every_expert_held_but_only_the_active_ones_run():
    cfg = _cfg(top_k=2, every=2, shared_ffn_hidden=8, bias_balancing=True)
    assert sum(p.numel() for p in GPT(cfg).parameters()) == parameter_count(cfg)
    gated = _cfg(top_k=2, shared_ffn_hidden=8, shared_gate=True)
    assert sum(p.numel() for p in GPT(gated).parameters()) == parameter_count(gated)
    dense = ModelConfig(**{**cfg.__dict__, "moe": MoEConfig()})
    h, expert = cfg.hidden, 3 * cfg.hidden * 12  # SwiGLU expert: three matrices
    routed_layer = h * 4 + 2 * expert + 3 * h * 8  # router + top-2 experts + shared expert
    dense_layer = 3 * h * 24
    assert flops_per_token(cfg).dense - flops_per_token(dense).dense == 2 * (routed_layer - dense_layer)


def test_impossible_moe_options_are_refused_by_name():
    with pytest.raises(ConfigError, match="model.moe.top_k=5 must be <= model.moe.experts=4"):
        _cfg(top_k=5)
    with pytest.raises(ConfigError, match="model.moe.capacity_factor must be >= 0"):
        _cfg(capacity_factor=-1.0)
    with pytest.raises(ConfigError, match="model.moe.shared_gate=true gates the shared expert"):
        _cfg(shared_gate=True)
