"""Two-stage behaviour: the snapshot is isolated from later steps, one save in flight
(wait/skip), fsspec URLs, and `megascale export`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megascale.checkpoint.export import whole_tensors
from megascale.interop.pretrained import load_pretrained
from megascale.train.trainer import Trainer
from tests.checkpoint.conftest import tiny_config, train

pytestmark = pytest.mark.timeout(300)


def test_snapshot_is_not_changed_by_later_steps(tmp_path):
    """Stage 2 at 0.5 MB/s writes step 5's state while steps 6..10 change every parameter."""
    trainer = Trainer(
        tiny_config(tmp_path, "--train.steps=5", "--checkpoint.every=0", "--checkpoint.write_mb_per_s=0.5")
    )
    for _ in range(5):
        trainer.run_step()
    at_save = {n: p.detach().clone() for n, p in trainer.runner.named_parameters()}
    trainer.checkpoints.save()
    assert trainer.checkpoints.last_stall_s < 1.0
    for _ in range(5):
        trainer.run_step()
    assert trainer.checkpoints._inflight == 5, "stage 2 should still be writing"
    changed = {n: p.detach() for n, p in trainer.runner.named_parameters()}
    assert all(not torch.equal(changed[n], at_save[n]) for n in at_save)
    trainer.close()
    tensors, manifest = whole_tensors(str(tmp_path / "checkpoints"))
    assert manifest["step"] == 5
    for name, value in at_save.items():
        assert torch.equal(tensors[(name, "value")], value), name


def test_when_busy_skip_and_wait(tmp_path):
    slow = "--checkpoint.write_mb_per_s=0.5"  # ~3 s per save, steps take milliseconds
    train(tmp_path / "skip", 4, "--checkpoint.every=1", "--checkpoint.when_busy=skip", slow)
    log = (tmp_path / "skip" / "rank00000.log").read_text()
    assert "skipped: the save of step 1 is still being written" in log
    train(tmp_path / "wait", 2, "--checkpoint.every=1", "--checkpoint.when_busy=wait", slow)
    log = (tmp_path / "wait" / "rank00000.log").read_text()
    assert "checkpoint at step 2 waits for the save of step 1" in log
    steps = sorted(p.name for p in (tmp_path / "wait" / "checkpoints").glob("step_*"))
    assert steps == ["step_000000001", "step_000000002"]


def test_fsspec_url_directory(tmp_path):
    url = f"file://{tmp_path}/remote/ckpt"
    train(tmp_path, 5, "--checkpoint.every=5", f"--checkpoint.dir={url}")
    assert (tmp_path / "remote" / "ckpt" / "step_000000005" / "manifest.json").exists()
    _, _, trainer = train(tmp_path, 6, f"--checkpoint.dir={url}")
    assert trainer.checkpoints.last_restore["step"] == 5


def test_export_loads_into_single_process_gpt(tmp_path):
    """`megascale export` (a Hugging Face directory, tests/interop covers its formats) reads back
    into a single-process GPT that computes the trained model."""
    _, _, trainer = train(tmp_path, 5, "--checkpoint.every=5")
    out = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "export", str(tmp_path / "checkpoints"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    model, _ = load_pretrained(out)
    tokens = torch.randint(0, 256, (2, 64))
    trainer.runner.module.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, tokens), trainer.runner.module(tokens, tokens), rtol=1e-6, atol=0)
    missing = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "export", str(tmp_path / "nothing"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "no valid checkpoint" in missing.stderr
