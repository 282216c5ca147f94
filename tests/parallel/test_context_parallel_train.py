"""`megascale train` under context parallelism, end to end: the real data loader (the cp ranks of a
dp coordinate read the same batch, each trains its part of every sequence), ring attention
(the default model has full causal attention), and checkpoints across cp: saved at cp2,
resumed at cp2 (the same losses and state, bit for bit) and at cp1 (the same losses, within
the float error of summing the sequence's gradient in a different order)."""

from __future__ import annotations

import json

import pytest
import torch

from megascale.checkpoint.export import whole_tensors
from megascale.checkpoint.storage import MANIFEST
from megascale.config import load_config
from megascale.train.trainer import Trainer

from cli_train import TINY, cli_losses  # isort: skip

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CP2 = ["--nproc", "2", "--parallel.cp=2"]


def _one_process(tmp, name: str, *extra: str) -> list[float]:
    """The same job in this process (what `megascale train` without --nproc runs; no start-up)."""
    run = [f"--train.run_dir={tmp / name}"]
    trainer = Trainer(load_config(None, [*TINY, *run, *extra]))
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _state(path) -> dict[str, torch.Tensor]:
    tensors, _ = whole_tensors(str(path), fields=("value", "optim.exp_avg", "optim.exp_avg_sq"))
    return tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4 steps in one process; 4 steps at cp2 with checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("cp")
    return tmp, _one_process(tmp, "cp1"), cli_losses(tmp, "cp2", [*CP2, "--checkpoint.every=2"])


def test_cp2_through_the_real_loader_trains_as_one_process(runs):
    _, single, cp2 = runs
    assert len(single) == len(cp2) == 4
    assert single[0] != pytest.approx(single[-1], rel=1e-3)  # the steps trained
    assert cp2 == pytest.approx(single, rel=1e-5)


def test_a_cp2_checkpoint_resumes_at_cp2_exactly_and_at_cp1(runs):
    tmp, _, cp2 = runs
    saved = tmp / "cp2" / "checkpoints" / "step_000000002"
    assert json.loads((saved / MANIFEST).read_text())["layout"]["cp"] == 2
    again = cli_losses(tmp, "again-cp2", [*CP2, "--checkpoint.every=2", f"--checkpoint.resume={saved}"])
    assert again == cp2[2:]  # the loader resumed at batch 2, the state bit for bit
    final = "checkpoints/step_000000004"
    mine, want = _state(tmp / "again-cp2" / final), _state(tmp / "cp2" / final)
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want)
    one = _one_process(tmp, "again-cp1", f"--checkpoint.resume={saved}")
    assert one == pytest.approx(cp2[2:], rel=1e-5)
