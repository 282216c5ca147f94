"""Checkpoints of the real 3D-parallel trainer: exact resume at (pp, dp, tp) = (2, 2, 2), and
resharding 2x2x2 -> (dp=4, tp=1, pp=2) -> one process with identical state and matching
next-step losses. 8 gloo ranks through `megascale train --nproc 8`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megascale.checkpoint.export import whole_tensors
from tests.checkpoint.conftest import train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TINY = [
    "--model.layers=2",
    "--model.hidden=64",
    "--model.heads=4",
    "--model.seq_len=64",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    "--train.device=cpu",
    "--train.tensorboard=false",
    "--train.eval_every=0",
    "--optim.decay_steps=20",
]
L222 = ["--parallel.pp=2", "--parallel.dp=2", "--parallel.tp=2"]
L412 = ["--parallel.pp=2", "--parallel.dp=4", "--parallel.tp=1"]


def megascale_train(run_dir, *args: str, nproc: int = 8) -> list[float]:
    """Run `nproc` ranks; returns the losses of the steps run (from metrics.jsonl)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "train",
            "--nproc",
            str(nproc),
            *TINY,
            f"--train.run_dir={run_dir}",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode:
        errors = [
            line
            for line in (done.stdout + done.stderr).splitlines()
            if "Error" in line or "terminate" in line or "ERROR" in line
        ]
        pytest.fail(f"megascale train exited {done.returncode}:\n" + "\n".join(errors[-30:]))
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in metrics]


def state_of(url) -> dict:
    tensors, _ = whole_tensors(str(url), fields=("value", "optim.exp_avg", "optim.exp_avg_sq"))
    return tensors


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def straight_222(tmp_path_factory):
    """8 steps at 2x2x2, checkpoints at 4 and 8."""
    run = tmp_path_factory.mktemp("straight222")
    losses = megascale_train(run, *L222, "--train.steps=8", "--checkpoint.every=4", "--checkpoint.resume=none")
    return run, losses


def test_resume_exact_2x2x2(tmp_path, straight_222):
    run, losses = straight_222
    resumed = megascale_train(
        tmp_path,
        *L222,
        "--train.steps=8",
        "--checkpoint.every=0",
        f"--checkpoint.resume={run / 'checkpoints' / 'step_000000004'}",
    )
    assert resumed == losses[4:]
    assert_same(state_of(tmp_path / "checkpoints" / "step_000000008"), state_of(run / "checkpoints" / "step_000000008"))


def test_reshard_2x2x2_to_4x1x2_to_one_process(tmp_path, straight_222):
    run, losses = straight_222
    source = run / "checkpoints" / "step_000000004"
    # 2x2x2 -> dp=4, tp=1, pp=2: loaded and saved again unchanged (no step to run)
    megascale_train(tmp_path / "r412", *L412, "--train.steps=4", f"--checkpoint.resume={source}")
    resharded = tmp_path / "r412" / "checkpoints" / "step_000000004"
    assert_same(state_of(resharded), state_of(source))
    # -> one process: same state again, then the next steps' losses match the 2x2x2 run
    _, _, trainer = train(tmp_path / "r111", 4, f"--checkpoint.resume={resharded}")
    assert_same(state_of(tmp_path / "r111" / "checkpoints" / "step_000000004"), state_of(source))
    more, _, _ = train(tmp_path / "r111", 8, "--checkpoint.every=0", "--train.micro_batch=1")
    assert more == pytest.approx(losses[4:], rel=1e-5)
