"""Preemption: SIGTERM (or Ctrl-C) stops every rank after the same step, which is saved.

In-process tests of the handler, and two 2-rank runs of `megascale train --nproc 2`: one where
the signal reaches a single rank (`term` fault, keyed by rank and step), one where it reaches
only the outer launcher (as Kubernetes signals only a container's first process)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megascale.checkpoint.shm import PREFIX, SHM_DIR
from megascale.train import stop as stop_module
from megascale.train.stop import StopOnSignal

pytestmark = pytest.mark.timeout(400)

TINY = [
    "--model.layers=2",
    "--model.hidden=32",
    "--model.heads=2",
    "--model.seq_len=32",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    "--train.device=cpu",
    "--train.eval_every=0",
    "--train.tensorboard=false",
    "--checkpoint.every=0",
    "--parallel.dp=2",
    "--train.steps=100000",
]


def test_first_signal_is_recorded_and_agreed():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        assert stop.agreed(torch.device("cpu")) == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        assert stop.agreed(torch.device("cpu")) == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # the same request by a second route: ignored
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_later_second_ctrl_c_interrupts_at_once(monkeypatch):
    monkeypatch.setattr(stop_module, "REPEAT_WINDOW_S", 0.0)
    with StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode; never reached


def test_disabled_leaves_handlers_alone():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal(enabled=False) as stop:
        assert signal.getsignal(signal.SIGTERM) is before
        assert stop.agreed(torch.device("cpu")) == 0


def _launch(run_dir: Path, *extra: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "megascale.cli",
        "train",
        "--nproc",
        "2",
        *TINY,
        f"--train.run_dir={run_dir}",
        *extra,
    ]
    out = open(run_dir.parent / f"{run_dir.name}.out", "wb")  # noqa: SIM115 - lives as long as the run
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit within {timeout} s:\n" + _output(run_dir))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and ranks, whatever happened


def _output(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.out").read_text(errors="replace")[-4000:]


def _saved_steps(run_dir: Path) -> list[int]:
    return [json.loads(m.read_text())["step"] for m in (run_dir / "checkpoints").glob("step_*/manifest.json")]


def _resume_one_more_step(run_dir: Path, step: int) -> None:
    proc = _launch(run_dir, f"--train.steps={step + 1}")
    assert _finish(proc, run_dir) == 0, _output(run_dir)
    assert f"at step {step}" in (run_dir / "rank00000.log").read_text()


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_all_after_the_same_step(tmp_path):
    run_dir = tmp_path / "one_rank"
    proc = _launch(run_dir, env_extra={"MEGASCALE_FAULT": "term:rank=1:step=3"})
    code = _finish(proc, run_dir)
    assert code != 0, _output(run_dir)  # preempted, not finished
    assert _saved_steps(run_dir) == [3], _output(run_dir)
    for rank in (0, 1):
        assert "stopping at step 3 on SIGTERM" in (run_dir / f"rank{rank:05d}.log").read_text()
    _resume_one_more_step(run_dir, 3)


@pytest.mark.slow
def test_sigterm_to_the_launcher_while_a_save_is_queued(tmp_path):
    """Throttled saves every 2 steps (when_busy=wait), so a save is being written when SIGTERM
    reaches the launcher and the ranks' final save queues behind it. torchrun signals each rank's
    process group; the writers, in their own sessions, finish both commits; the launcher reports
    what storage holds, and no shared memory is left behind."""
    run_dir = tmp_path / "launcher"
    # 0.03 MB/s: the save of step 2 (0.5 MB) takes ~9 s (at 0.1 MB/s 2.7 s, about a loaded step),
    # so the stop finds it in flight. The final save logs its wait; before, it waited silently and
    # this check, reading only a regular save's line, failed on CI when the stop came at step 3
    proc = _launch(run_dir, "--checkpoint.every=2", "--checkpoint.write_mb_per_s=0.03")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # to the outer process only
    code = _finish(proc, run_dir)
    assert code != 0, _output(run_dir)
    logs = [(run_dir / f"rank{rank:05d}.log").read_text() for rank in (0, 1)]
    stopped = int(re.search(r"stopping at step (\d+) on SIGTERM", logs[0]).group(1))
    assert all(f"stopping at step {stopped} on SIGTERM" in log for log in logs)
    assert not any("writer process died" in log or "FAILED" in log for log in logs), logs[0][-3000:]
    assert "waits for the save of step" in logs[0]  # the queued case did happen (a save's or the final one)
    assert max(_saved_steps(run_dir)) == stopped, _output(run_dir)
    assert f"megascale train: stopped by SIGTERM; step {stopped} is saved in" in _output(run_dir)
    run_id = json.loads(next((run_dir / "checkpoints").glob("step_*/manifest.json")).read_text())["run_id"]
    assert list(SHM_DIR.glob(f"{PREFIX}{run_id}-*")) == []
    _resume_one_more_step(run_dir, stopped)
