"""Ctrl-C saves a checkpoint of the step reached and exits cleanly; the next run resumes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.checkpoint.conftest import TINY

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_ctrl_c_saves_and_resume_continues(tmp_path):
    args = [
        sys.executable,
        "-m",
        "megascale.cli",
        "train",
        *TINY,
        f"--train.run_dir={tmp_path}",
        "--train.steps=100000",
        "--checkpoint.every=0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # SIGABRT prints every stack
    err_file = tmp_path / "stderr.txt"  # a file, not a pipe nobody reads while training runs
    with open(err_file, "wb") as err:
        # SIGINT as a terminal delivers it: a suite started in the background (`cmd &` from a
        # script) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
        proc = subprocess.Popen(
            args,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(timeout=30)
        pytest.fail("no exit 120 s after Ctrl-C; stacks:\n" + err_file.read_text()[-6000:])
    assert code == 130, err_file.read_text()[-2000:]
    manifests = list((tmp_path / "checkpoints").glob("step_*/manifest.json"))
    assert len(manifests) == 1
    saved = json.loads(manifests[0].read_text())["step"]
    assert saved >= 3
    done = subprocess.run(
        args[:-2] + [f"--train.steps={saved + 1}"], env=env, capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"at step {saved}" in (tmp_path / "rank00000.log").read_text()
