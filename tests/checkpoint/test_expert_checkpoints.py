"""Checkpoints of a mixture-of-experts model under expert parallelism (dp = 2, ep = 2: each rank
holds half the experts): an exact resume at the same layout, and the same checkpoint resumed on
one process (ep = 1, every expert on one rank) giving the next steps' losses of the ep = 2 run.
Nothing is specific to experts in the checkpoint: pieces are keyed by parameter name and
`ShardSpec`; what the manifest adds is the ep degree, named by the resume line."""

from __future__ import annotations

import logging

import pytest

from tests.checkpoint.conftest import train
from tests.checkpoint.test_checkpoint_layouts import assert_same, megascale_train, state_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MOE = [
    "--model.block=serial",
    "--model.norm=rmsnorm",
    "--model.mlp=swiglu",
    "--model.bias=false",
    "--model.moe.experts=4",
    "--model.moe.top_k=2",
    "--model.moe.ffn_hidden=64",
]
EP2 = ["--parallel.dp=2", "--parallel.ep=2"]


@pytest.fixture(scope="module")
def straight_ep2(tmp_path_factory):
    """4 steps at dp = ep = 2, checkpoints at 2 and 4."""
    run = tmp_path_factory.mktemp("ep2")
    losses = megascale_train(
        run, *MOE, *EP2, "--train.steps=4", "--checkpoint.every=2", "--checkpoint.resume=none", nproc=2
    )
    return run, losses


def test_resume_exact_at_ep2(tmp_path, straight_ep2):
    run, losses = straight_ep2
    resumed = megascale_train(
        tmp_path,
        *MOE,
        *EP2,
        "--train.steps=4",
        "--checkpoint.every=0",
        f"--checkpoint.resume={run / 'checkpoints' / 'step_000000002'}",
        nproc=2,
    )
    assert resumed == losses[2:]
    assert_same(state_of(tmp_path / "checkpoints" / "step_000000004"), state_of(run / "checkpoints" / "step_000000004"))


class _Lines(logging.Handler):
    """The messages of one logger ("megascale" does not propagate to pytest's handler)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_ep2_checkpoint_resumes_on_one_process(tmp_path, straight_ep2):
    run, losses = straight_ep2
    logger, seen = logging.getLogger("megascale.checkpoint"), _Lines()
    logger.addHandler(seen)
    try:
        more, _, _ = train(
            tmp_path,
            4,
            *MOE,
            "--checkpoint.every=0",
            "--train.micro_batch=1",
            f"--checkpoint.resume={run / 'checkpoints' / 'step_000000002'}",
        )
    finally:
        logger.removeHandler(seen)
    assert any("at step 2 (saved as pp=1 dp=2 ep=2 cp=1 tp=1, 2 ranks;" in line for line in seen.lines), seen.lines
    assert more == pytest.approx(losses[2:], rel=1e-5)
