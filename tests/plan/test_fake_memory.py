"""The planner's memory model against one rank built by the trainer's code in fake mode."""

from __future__ import annotations

import pytest

from megascale.config import load_config
from megascale.testing.fake_memory import compare_with_plan

STATE_TOLERANCE = 0.02  # parameters, gradient shards, masters + moments: the same arithmetic


def small_job(tp: int, pp: int, dp: int, optimizer: str = "adamw"):
    return load_config(
        None,
        overrides=[
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


@pytest.mark.xfail(
    strict=True,
    reason="known gap (docs/planning.md, 'Memory against fake mode'): "
    "the trainer saves more activations than the planner counts",
)
def test_activations_match_the_fake_mode_build():
    cmp = compare_with_plan(small_job(2, 2, 2))
    assert cmp["activations"]["ratio"] == pytest.approx(1.0, abs=0.05), cmp["activations"]
