"""FLOPs, parameter and memory terms against values computed by hand for a tiny model."""

from __future__ import annotations

import pytest

from megascale.plan.cost import estimate
from megascale.plan.layout import Layout
from megascale.plan.memory import (
    ZERO_IN_FLIGHT,
    activation_bytes_per_token,
    activation_elements_per_token,
    in_flight_micro_batches,
    memory_per_gpu,
    param_split,
)

# Hand computation, h=8, f=32, vocab=100, seq=16, 2 serial layers with biases, learned positions:
#   layer: qkv 3*8*8+3*8=216, out 8*8+8=72, MLP 8*32+32+32*8+8=552, two LayerNorms 2*2*8=32
LAYER = 216 + 72 + 552 + 32  # 872
EMBED = 100 * 8 + 16 * 8  # token + position embeddings: 928
HEAD = 100 * 8 + 2 * 8  # untied head + final LayerNorm: 816
TOTAL = 2 * LAYER + EMBED + HEAD  # 3488
# forward FLOPs per token: dense 2 layers * 2 * (4*64 + 2*8*32) = 3072; attention: mean causal
# span (16+1)/2 = 8.5 keys, 2 layers * 2 * 2 * 8.5 * 8 = 544; head 2 * 8 * 100 = 1600
FWD_FLOPS = 3072 + 544 + 1600


def test_parameter_split(tiny):
    split = param_split(tiny)
    assert (split.layer, split.embedding, split.head) == (LAYER, EMBED, HEAD)
    assert split.stage(2, 1) == TOTAL
    assert split.stage(2, 2) == LAYER + EMBED  # the larger end sits on the first stage


def test_model_flops_per_step(tiny, a100):
    est = estimate(tiny, Layout(dp=1), a100)
    tokens = 8 * 16
    assert est.tokens_per_step == tokens
    assert est.model_flops_per_step == pytest.approx(tokens * 3 * FWD_FLOPS)


def test_model_state_memory(tiny, a100):
    # dp=2 ZeRO-2, bf16: bf16 params whole, fp32 grads and 12-byte optimizer state sharded
    mem = memory_per_gpu(tiny, Layout(dp=2, micro_batch=2, zero=2), a100.gpu)
    assert mem.params == 2 * TOTAL
    assert mem.grads == 4 * TOTAL / 2
    assert mem.optimizer == 12 * TOTAL / 2
    mem0 = memory_per_gpu(tiny, Layout(dp=2, micro_batch=2, zero=0), a100.gpu)
    assert (mem0.grads, mem0.optimizer) == (4 * TOTAL, 12 * TOTAL)
    mem3 = memory_per_gpu(tiny, Layout(dp=2, micro_batch=2, zero=3), a100.gpu)
    assert mem3.params == 2 * TOTAL / 2


def test_published_systems_activation_and_buffer_memory(tiny, a100):
    # Korthikanti et al.: saved per token per layer (serial): 2 norms x (in + out) 32 + q,k,v,o 32
    # + GeLU in, fc2 in 64
    assert activation_elements_per_token(tiny, "none") == 128
    assert activation_elements_per_token(tiny, "selective") == 128 - 2 * 8 - 32
    assert activation_elements_per_token(tiny, "full") == 8
    mem = memory_per_gpu(tiny, Layout(dp=2, micro_batch=2, zero=2), a100.gpu)
    tokens = 2 * 16
    per_layer = tokens * 128 * 2 + tokens * 2 * 4  # bf16 activations + fp32 log-sum-exp per head
    assert mem.activations == 2 * per_layer  # 2 layers, one micro-batch in flight (pp=1)
    grad_and_gathered = LAYER * (4 + 2 * 2)  # one unsharded fp32 layer grad + 2 bf16 layers
    logits = tokens * 100 * (2 + 4)
    assert mem.buffers == grad_and_gathered + logits


def test_as_built_activation_and_buffer_memory(tiny, a100):
    # megascale's code, saved per token per layer (serial, bf16, tp 1), bytes: 2 norm inputs with
    # their mean and 1/std 40, 2 GEMM inputs (the norm outputs) 32, q,k,v 48, the attention
    # output 16, GeLU in and fc2 in 128; fp32 log-sum-exp per head 8. Selective recomputes the
    # log-sum-exp; full keeps the input.
    assert activation_bytes_per_token(tiny, "none") == 264 + 8
    assert activation_bytes_per_token(tiny, "selective") == 264
    assert activation_bytes_per_token(tiny, "full") == 16
    mem = memory_per_gpu(tiny, Layout(dp=2, micro_batch=2, zero=2), a100.gpu, as_built=True)
    tokens = 2 * 16
    per_layer = tokens * (264 + 8)
    # token ids and the embedding's mask 9; the head (pp = 1): its norm's input 20, its GEMM's 16
    extra = tokens * (9 + 20 + 16)
    assert mem.activations == 2 * per_layer + extra  # 2 layers, one micro-batch in flight (pp=1)
    # bf16 .grad of every parameter, and ZeRO's buffers: the whole model in one bucket, fp32
    gradients = 2 * TOTAL + 2 * (TOTAL / 2) * 4
    logits = tokens * 100 * (2 + 4)
    assert mem.buffers == gradients + logits
    assert mem.total == pytest.approx(
        2 * TOTAL + 2 * TOTAL + 6 * TOTAL + 2 * per_layer + extra + gradients + logits + a100.gpu.reserved_bytes
    )


def test_zero_buffers_in_flight_are_zeros():
    from megascale.parallel.zero import IN_FLIGHT

    assert ZERO_IN_FLIGHT == IN_FLIGHT


def test_in_flight_micro_batches():
    assert in_flight_micro_batches(Layout(dp=1, pp=4), 16) == 4
    assert in_flight_micro_batches(Layout(dp=1, pp=4), 2) == 2
    assert in_flight_micro_batches(Layout(dp=1, pp=4, v=2), 16) == pytest.approx(4 * (1 + 3 / 8))


def test_full_recompute_adds_one_forward(tiny, a100):
    base = estimate(tiny, Layout(dp=1), a100)
    full = estimate(tiny, Layout(dp=1, recompute="full"), a100)
    assert full.terms["recompute"] > 0
    # the recomputed forward is the layers' forward (not the head's)
    assert full.terms["recompute"] == pytest.approx(base.micro_batches * 2 * base.detail["layer_fwd"])
    assert full.mfu < base.mfu  # recomputation is not useful work


@pytest.mark.parametrize("block", ["parallel", "serial"])
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_terms_match_the_real_model(block, positions):
    """Parameter split equals megascale.model's GPT; saved activations match autograd's."""
    import torch

    from megascale.config import ModelConfig
    from megascale.model import GPT, Block
    from megascale.plan.layout import Workload

    cfg = ModelConfig(vocab_size=100, seq_len=64, layers=2, hidden=64, heads=4, block=block, positions=positions)
    work = Workload(cfg, global_batch=8, dtype="fp32")
    split = param_split(work)
    assert split.stage(2, 1) == sum(p.numel() for p in GPT(cfg).parameters())
    layer = Block(cfg)
    assert split.layer == sum(p.numel() for p in layer.parameters())

    saved: dict[int, int] = {}  # storage -> bytes
    params = {p.untyped_storage()._cdata for p in layer.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return t

    x = torch.randn(2, 64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    per_token = sum(saved.values()) / (2 * 64)
    assert per_token == pytest.approx(activation_bytes_per_token(work, "none"), rel=0.03)
