"""A rank's compute time, the fail-slow rule's input, is its own work: never its wait for a peer.

Two gloo ranks train a tiny model at dp=2 with the real trainer, LAMB and ZeRO, and report
their steps through the executor's status file (`StepHook`, what the driver reads). Rank 1 is
slow in two places of every step: after its gradients are final (its peer then waits in the
gradient norm's all-reduce) and at the start of LAMB's step (its peer waits in LAMB's sharded
norms). Both waits sit inside the trainer's `optimizer` span; untimed, rank 0 reported about as
much "compute" as the slow rank, and the rule's ratio of a slowed node to its peers shrank
toward 1 (the fail-slow end-to-end test named its node late, or never).
"""

from __future__ import annotations

import os
import time

import pytest

from megascale.config import default_config_path, load_config
from megascale.resilience.common.rankstatus import STATUS_DIR_ENV, read_status
from megascale.testing.launch import run_local

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(300)]  # 2 ranks, ~30-50 s; times vs a bound

SLOW_S = 1.0  # rank 1's extra work at each of its two places, per step
STEPS = 4


def _rank(run_dir: str) -> list[list[float]]:
    from megascale.resilience.rank.faults import StepHook
    from megascale.train.trainer import Trainer

    cfg = load_config(
        default_config_path(),
        [
            "--parallel.dp=2",
            "--model.layers=2",
            "--model.hidden=64",
            "--model.heads=4",
            "--model.seq_len=64",
            "--train.global_batch=4",
            "--train.micro_batch=2",
            f"--train.steps={STEPS}",
            "--train.tensorboard=false",
            "--train.eval_every=0",
            "--checkpoint.every=0",
            "--checkpoint.resume=none",
            "--diagnostics.flight_recorder=false",
            f"--train.run_dir={run_dir}",
        ],
    )
    trainer = Trainer(cfg)
    try:
        if trainer.rank == 1:
            finish = trainer.runner.finish_grads

            def slow_finish() -> None:
                finish()
                time.sleep(SLOW_S)  # before the gradient norm's all-reduce

            trainer.runner.finish_grads = slow_finish  # type: ignore[method-assign]
            trainer.optimizer.register_step_pre_hook(lambda *_: time.sleep(SLOW_S))  # before LAMB's norms
        hook = StepHook(trainer.rank, {STATUS_DIR_ENV: os.path.join(run_dir, "status")}, facts=trainer)
        trainer.step_hooks.append(hook)
        trainer.fit()
    finally:
        trainer.close()
    status = read_status(os.path.join(run_dir, "status"), trainer.rank)
    assert status is not None
    return status["compute"]


def test_a_fast_rank_reports_its_own_work_not_its_wait_for_a_slow_peer(tmp_path):
    fast, slow = run_local(_rank, 2, args=(str(tmp_path / "run"),), timeout_s=240)
    assert [s for s, _ in fast] == [s for s, _ in slow] == list(range(1, STEPS + 1))
    for (step, mine), (_, theirs) in list(zip(fast, slow, strict=True))[1:]:  # step 1 pays one-off costs
        assert theirs >= SLOW_S, (step, theirs)  # the pre-hook's sleep is inside the optimizer span
        # rank 0 waited ~2 x SLOW_S in collectives; its own work on this tiny model is far less
        assert mine < SLOW_S / 2, (step, mine, theirs)
