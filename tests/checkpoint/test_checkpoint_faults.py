"""Faults injected for real: a killed writer, storage that is full or refuses writes, a flipped
byte, a missing manifest. Nothing committed is lost and training goes on."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import threading
import time
import uuid

import pytest
import torch

from megascale.checkpoint.storage import CheckpointError
from megascale.cli import main as megascale_main
from megascale.train.trainer import Trainer
from tests.checkpoint.conftest import TINY, assert_same_params, tiny_config, train

pytestmark = pytest.mark.timeout(300)


def log_text(run_dir) -> str:
    """The trainer's log (its logger does not propagate to pytest's capture)."""
    return (run_dir / "rank00000.log").read_text()


def committed_steps(root) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_") and "." not in p.name)


def test_killed_writer_keeps_previous_and_the_final_save_is_retried(tmp_path, straight_run):
    """The writer is SIGKILLed while it writes step 10, the run's last step. Step 5 stays the
    newest commit; the trainer, which waits for the final save's commit, sees the writer die,
    starts another and saves step 10 again, and says so."""
    train(tmp_path, 5, "--checkpoint.every=5")
    root = tmp_path / "checkpoints"
    trainer = Trainer(
        tiny_config(tmp_path, "--train.steps=10", "--checkpoint.every=5", "--checkpoint.write_mb_per_s=0.5")
    )
    seen_at_kill: list[list[int]] = []

    def kill_while_writing_step_10() -> None:  # stage 2 at 0.5 MB/s takes seconds
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(p.stat().st_size for p in root.glob("step_000000010.tmp-*/rank-00000.bin")):
                seen_at_kill.append(committed_steps(root))
                os.kill(trainer.checkpoints.writer_pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_while_writing_step_10)
    killer.start()
    trainer.fit()
    killer.join()
    trainer.close()
    assert seen_at_kill == [[5]], "stage 2 never started writing"
    log = log_text(tmp_path)
    assert "FAILED" in log and "writer process died" in log
    assert trainer.final_save.saved and committed_steps(root) == [5, 10]
    losses, params, resumed = train(tmp_path, 20, "--checkpoint.every=0")
    assert resumed.checkpoints.last_restore["step"] == 10
    assert losses == straight_run[0][10:]
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


def test_unwritable_directory_training_continues_and_the_run_fails(tmp_path, capsys):
    """Every save fails: training still runs to the end, then the run exits 1 saying that its
    last step is not saved (through `megascale train`'s own entry point, in this process)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = megascale_main(
        [
            "train",
            *TINY,
            f"--train.run_dir={tmp_path}",
            "--train.steps=10",
            "--checkpoint.every=5",
            f"--checkpoint.dir={blocker}/checkpoints",
        ]
    )
    assert code == 1
    assert "step 10 was NOT saved" in capsys.readouterr().err
    log = log_text(tmp_path)
    assert "FAILED" in log and "training continues" in log and "step 10/10" in log


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount)], capture_output=True)
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
