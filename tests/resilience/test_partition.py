"""Correlated silence (issue 29): every executor of a live job stopped for 8 s (SIGSTOP: no
heartbeat reaches the driver, as in a network partition or a driver stall seen from the other
side), then resumed. Twice the heartbeat timeout, yet nobody is evicted: most nodes silent at
once is not a node fault (`silence.py`). The ranks train on meanwhile and the job completes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.resilience.jobs import max_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
PAUSE_S = 8.0


def test_every_executor_paused_for_8_s_is_no_fault_and_training_goes_on(job_factory):
    job = job_factory(extra=("--train.steps=40",))
    job.start()
    before = job.wait_for(lambda s: s["phase"] == "running" and max_step(s) >= 3)
    pids = list(job.executor_pids().values())
    assert len(pids) == 3  # two active nodes and the spare
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)  # heartbeat_timeout_s is 4 s (tests/resilience/jobs.py)
        during = job.status()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert during is not None and during["silence"]["correlated"] and during["evicted"] == [], during
    after = job.wait_for(lambda s: all(n["last_seen_s"] < 2 for n in s["nodes"].values()))
    assert after["faults"] == [] and after["evicted"] == [] and after["attempt"] == 0, after
    assert max_step(after) > max_step(before)  # the ranks did not wait for their executors
    summary = job.finish()
    assert summary["faults"] == [] and summary["restarts"] == 0 and summary["evicted"] == [], summary
    assert summary["ettr"]["steps"] == 40
