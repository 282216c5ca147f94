"""A tiny model trained in-process through the real `Trainer`, for checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megascale.config import load_config
from megascale.train.trainer import Trainer

TINY = [
    "--model.layers=2",
    "--model.hidden=64",
    "--model.heads=4",
    "--model.seq_len=64",
    "--train.global_batch=4",
    "--train.micro_batch=2",
    "--train.device=cpu",
    "--train.tensorboard=false",
    "--train.eval_every=0",
    "--train.log_every=5",
    "--optim.decay_steps=20",  # the same LR schedule whether a run stops at 10 or 20
]


def tiny_config(run_dir: Path, *overrides: str):
    return load_config(None, TINY + [f"--train.run_dir={run_dir}", *overrides])


def train(run_dir: Path, steps: int, *overrides: str, keep_open: bool = False):
    """Run the trainer to `steps`; returns (losses of this call, parameters, trainer)."""
    trainer = Trainer(tiny_config(run_dir, f"--train.steps={steps}", *overrides))
    try:
        losses = trainer.fit()
    finally:
        if not keep_open:
            trainer.close()
    params = {n: p.detach().clone() for n, p in trainer.runner.named_parameters()}
    return losses, params, trainer


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
    """20 steps without stopping (no checkpoints), the reference for resumed runs."""
    run_dir = tmp_path_factory.mktemp("straight")
    losses, params, _ = train(run_dir, 20, "--checkpoint.every=0", "--checkpoint.resume=none")
    return losses, params


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A run directory with committed checkpoints at steps 5 and 10 (tests copy it)."""
    run = tmp_path_factory.mktemp("trained")
    train(run, 10, "--checkpoint.every=5")
    return run


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
