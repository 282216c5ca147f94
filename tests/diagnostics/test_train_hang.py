"""A rank stopped inside `megascale train`: the trainer's watchdogs dump, the analysis names it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megascale.diagnostics.hang import analyse, load_dumps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN = [
    "--model.layers=4",
    "--model.hidden=32",
    "--model.heads=2",
    "--model.seq_len=32",
    "--train.steps=100000",
    "--train.global_batch=8",
    "--train.micro_batch=1",
    "--train.device=cpu",
    "--train.eval_every=0",
    "--train.tensorboard=false",
    "--checkpoint.every=0",
    "--parallel.pp=2",
    "--parallel.tp=2",
    "--diagnostics.hang_timeout_s=3",
]
STOPPED = 3  # pp=1, dp=0, tp=1


def _rank_processes(root: psutil.Process) -> dict[int, psutil.Process]:
    """The training ranks: the launcher's own children (their helpers inherit RANK too)."""
    ranks = {}
    for child in root.children(recursive=True):
        try:
            rank = child.environ().get("RANK")
            launched = "torch.distributed.run" in " ".join(child.parent().cmdline())
        except psutil.Error:
            continue
        if rank is not None and launched:
            ranks[int(rank)] = child
    return ranks


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_stopped_rank_is_named_with_its_coordinates(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    log = (tmp_path / "out.log").open("w")
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "train",
            *TRAIN,
            f"--train.run_dir={run_dir}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 180, "three training steps")
        ranks = _wait_for(
            lambda: (r := _rank_processes(psutil.Process(job.pid))) and len(r) == 4 and r, 30, "four rank processes"
        )
        ranks[STOPPED].send_signal(signal.SIGSTOP)
        dumps = _wait_for(lambda: len(d := load_dumps(run_dir)) >= 3 and d, 60, "hang dumps")
        assert STOPPED not in dumps  # a stopped rank cannot say anything
        analysis = analyse(run_dir)
        assert analysis is not None
        assert analysis.stuck == [STOPPED], analysis.summary()
        assert analysis.ranks[STOPPED].coords == {"pp": 1, "dp": 0, "tp": 1}
    finally:  # the launcher starts ranks in sessions of their own: kill every descendant
        for proc in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        job.wait(timeout=30)
        log.close()
