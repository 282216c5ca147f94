"""Faults injected for real: a killed writer, storage that is full or refuses writes, a flipped
byte, a missing manifest. Nothing committed is lost and training goes on."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import time
import uuid

import pytest
import torch

from megascale.checkpoint.storage import CheckpointError
from megascale.train.trainer import Trainer
from tests.checkpoint.conftest import assert_same_params, tiny_config, train

pytestmark = pytest.mark.timeout(300)


def log_text(run_dir) -> str:
    """The trainer's log (its logger does not propagate to pytest's capture)."""
    return (run_dir / "rank00000.log").read_text()


def committed_steps(root) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_")
                  and "." not in p.name)


def test_killed_writer_keeps_previous(tmp_path, straight_run):
    train(tmp_path, 5, "--checkpoint.every=5")
    root = tmp_path / "checkpoints"
    assert committed_steps(root) == [5]
    # stage 2 at 0.2 MB/s takes seconds: kill the writer while it writes step 10
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=10", "--checkpoint.every=5",
                                  "--checkpoint.write_mb_per_s=0.2"))
    trainer.fit()
    deadline = time.monotonic() + 60
    partial = []
    while not partial and time.monotonic() < deadline:
        partial = [p for p in root.glob("step_000000010.tmp-*/rank-00000.bin") if p.stat().st_size]
        time.sleep(0.01)
    assert partial, "stage 2 never started writing"
    os.kill(trainer.checkpoints.writer_pid, signal.SIGKILL)
    trainer.close()
    assert "FAILED" in log_text(tmp_path) and "writer process died" in log_text(tmp_path)
    assert committed_steps(root) == [5]
    # the next run resumes from step 5 and trains exactly as if nothing had happened
    losses, params, resumed = train(tmp_path, 20, "--checkpoint.every=0")
    assert resumed.checkpoints.last_restore["step"] == 5
    assert losses == straight_run[0][5:]
    assert_same_params(params, straight_run[1])


def test_flipped_byte_falls_back_to_previous(tmp_path, straight_run):
    train(tmp_path, 10, "--checkpoint.every=5")
    data = tmp_path / "checkpoints" / "step_000000010" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    losses, _, trainer = train(tmp_path, 12, "--checkpoint.every=0")
    assert "sha256 mismatch" in log_text(tmp_path)
    assert trainer.checkpoints.last_restore["step"] == 5
    assert losses == straight_run[0][5:12]


def test_partial_checkpoint_is_skipped_and_explicit_bad_path_raises(tmp_path):
    train(tmp_path, 10, "--checkpoint.every=5")
    newest = tmp_path / "checkpoints" / "step_000000010"
    (newest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        train(tmp_path, 10, f"--checkpoint.resume={newest}")
    _, _, trainer = train(tmp_path, 10, "--checkpoint.every=0")
    assert "partial" in log_text(tmp_path) and trainer.checkpoints.last_restore["step"] == 5


def test_unwritable_directory_training_continues(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    losses, _, trainer = train(tmp_path, 10, "--checkpoint.every=5",
                               f"--checkpoint.dir={blocker}/checkpoints")
    assert len(losses) == 10 and trainer.step == 10
    assert "FAILED" in log_text(tmp_path) and "training continues" in log_text(tmp_path)
    assert trainer.checkpoints.last_result[0] == "error"


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_storage_keeps_older(tmp_path, small_tmpfs):
    """2.5 MB holds one 1.6 MB checkpoint: the second save hits ENOSPC."""
    args = ("--checkpoint.every=5", f"--checkpoint.dir={small_tmpfs}")
    losses, _, trainer = train(tmp_path, 10, *args)
    assert len(losses) == 10
    assert "No space left" in log_text(tmp_path)
    assert committed_steps(small_tmpfs) == [5]
    manifest = json.loads((small_tmpfs / "step_000000005" / "manifest.json").read_text())
    assert manifest["step"] == 5
    _, _, resumed = train(tmp_path / "again", 6, *args)
    assert resumed.checkpoints.last_restore["step"] == 5


def test_loading_runs_no_pickle(tmp_path, monkeypatch):
    train(tmp_path, 5, "--checkpoint.every=5")

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    for module, name in ((pickle, "loads"), (pickle, "load"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    _, _, trainer = train(tmp_path, 6, "--checkpoint.every=0")
    assert trainer.checkpoints.last_restore["step"] == 5
