"""The planner's memory model against one rank built by the trainer's code in fake mode."""

from __future__ import annotations

import pytest

from megascale.config import load_config
from megascale.testing.fake_memory import compare_with_plan

STATE_TOLERANCE = 0.02  # parameters, gradient shards, masters + moments: the same arithmetic


LLAMA = [  # serial block, RMSNorm, SwiGLU, grouped-query attention, a sliding window
    "--model.block=serial",
    "--model.norm=rmsnorm",
    "--model.mlp=swiglu",
    "--model.kv_heads=2",
    "--model.window=8",
    "--model.bias=false",
]


def small_job(tp: int, pp: int, dp: int, optimizer: str = "adamw", model: tuple[str, ...] = ()):
    return load_config(
        None,
        overrides=[
            *model,
            "--model.vocab_size=256",
            "--model.seq_len=32",
            "--model.layers=4",
            "--model.hidden=64",
            "--model.heads=4",
            f"--optim.name={optimizer}",
            f"--parallel.tp={tp}",
            f"--parallel.pp={pp}",
            f"--parallel.dp={dp}",
            "--parallel.vpp=1",
            "--parallel.pp_split=even",
            "--train.param_dtype=bf16",
            "--train.dtype=bf16",
            "--train.micro_batch=1",
            f"--train.global_batch={dp * pp}",
            "--train.recompute=none",
        ],
    )


@pytest.mark.parametrize(("tp", "pp", "dp", "optimizer"), [(2, 2, 2, "adamw"), (1, 1, 4, "lamb"), (2, 1, 1, "adamw")])
def test_model_state_matches_the_fake_mode_build(tp, pp, dp, optimizer):
    """Parameters (bf16), ZeRO-2's fp32 gradient shards and the fp32 masters + two moments
    per parameter of rank 0's stage are what the planner says, within 2%."""
    cmp = compare_with_plan(small_job(tp, pp, dp, optimizer))
    for key in ("params", "grads", "optimizer"):
        assert cmp[key]["ratio"] == pytest.approx(1.0, abs=STATE_TOLERANCE), (key, cmp[key])


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "model"),
    [
        (2, 2, 2, ()),
        (1, 1, 2, ()),
        (2, 1, 1, tuple(LLAMA)),
        (1, 2, 1, tuple(LLAMA[:-2]) + ("--model.positions=learned",)),
    ],
)
def test_activations_and_gradient_buffers_match_the_fake_mode_build(tp, pp, dp, model):
    """What autograd saves for one micro-batch of rank 0's first chunk (gathered tp inputs
    whole, fp32 RMSNorm internals, the attention output's copies, no fused-weight copy) and
    the gradients' buffers (every parameter's .grad until its bucket's launch, ZeRO's buffers
    in flight) are what the planner says, within 5%."""
    cmp = compare_with_plan(small_job(tp, pp, dp, model=model))
    for key in ("activations", "buffers"):
        assert cmp[key]["ratio"] == pytest.approx(1.0, abs=0.05), (key, cmp[key])
