"""Node faults on a local job of 2 nodes x 2 ranks (+1 spare): an executor killed, a node's
link cut in its network namespace, a node slowed, a node evicted by hand. Every run must end
complete with the reference run's final losses (rank faults: test_faults.py).

Slow (each job is ~1-2 minutes on 2 shared cores): `-m slow` selects them, `-m "not slow"` skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from megascale.resilience.driver.local import Netns, cut_link, netns_available
from tests.resilience.jobs import PAUSE, REPO, assert_same_losses, node_of_rank, paused_after_step_2, recovered

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_executor_killed_spare_takes_over_and_the_node_stays_out(job_factory, reference):
    job = job_factory(fault=PAUSE)
    job.start()
    status = job.wait_for(paused_after_step_2)
    victim = node_of_rank(status, 2)
    spare = next(name for name, n in status["nodes"].items() if n["role"] == "spare")
    os.kill(status["nodes"][victim]["pid"], signal.SIGKILL)
    evicted = job.wait_for(lambda s: victim in s["evicted"])
    assert evicted["nodes"][spare]["role"] == "active"  # the spare took the slot
    # The evicted node tries to come back: refused (exit code 3).
    back = subprocess.run(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "executor",
            "--driver",
            job.client.url,
            "--secret-dir",
            str(job.run_dir / "resilience" / "secret"),
            "--node-id",
            victim,
            "--address",
            "127.0.0.1",
            "--workdir",
            str(job.run_dir / "again"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert back.returncode == 3, back.stderr[-2000:]
    summary = job.finish()
    fault = recovered(summary)
    assert summary["evicted"] == [victim], summary
    assert fault["kind"] in ("heartbeat_lost", "abnormal_exit", "error_keyword", "hang")
    assert fault["path"] == "in_place" and fault["restore_source"] == "memory", fault  # node 0's ranks stayed
    assert_same_losses(job, reference)


def test_slow_node_is_an_alert_not_an_eviction(job_factory, reference):
    # Rank 2 (node 1) is stopped for 0.9 s of every second from step 6 on, by SIGSTOP/SIGCONT.
    # Step times swing 10x on this shared machine, so the alert threshold is 2x here (3x default).
    job = job_factory(fault="throttle:rank=2:step=6:stop=0.9:period=1.0", extra=("--resilience.slow_factor=2",))
    job.start()
    summary = job.finish()
    assert summary["restarts"] == 0 and summary["faults"] == [] and summary["evicted"] == [], summary
    assert any(a["kind"] == "slow" for a in summary["alerts"]), summary["alerts"]
    assert_same_losses(job, reference)


@pytest.mark.netns
@pytest.mark.skipif(netns_available() is not None, reason=f"{netns_available()}")
def test_network_cut_detected_named_by_selfcheck_evicted_spare_takes_over(job_factory, reference):
    job = job_factory(fault=PAUSE, netns=True)
    job.start()
    status = job.wait_for(paused_after_step_2)
    victim = node_of_rank(status, 2)
    netns = Netns(status["job_id"][:4])
    cut_link(netns, int(victim.removeprefix("node")))
    try:
        summary = job.finish()
    finally:  # the launcher removes the namespaces when the job ends; else let the node back in
        with contextlib.suppress(subprocess.CalledProcessError):
            cut_link(netns, int(victim.removeprefix("node")), up=True)
    fault = recovered(summary)
    assert fault["node"] == victim or fault["kind"] in ("hang", "abnormal_exit", "error_keyword")
    assert summary["evicted"] == [victim], summary
    # the fast path: node 0's ranks stayed, the spare took node 1's slot; the cut node cannot be
    # checked (nothing reaches it) and is evicted as lost
    assert fault["path"] == "in_place" and fault["selfcheck"]["run"] is True, fault
    conn = sqlite3.connect(job.run_dir / "resilience" / "driver.sqlite")
    evictions = [json.loads(row[0]) for row in conn.execute("SELECT data FROM events WHERE kind = 'evict'")]
    assert [(e["node"], e["reason"]) for e in evictions] == [(victim, "lost: no heartbeat")]
    assert_same_losses(job, reference)


def test_manual_eviction_without_spares_shrinks_dp(job_factory, reference):
    job = job_factory(fault=PAUSE, spares=0)
    job.start()
    status = job.wait_for(paused_after_step_2)
    victim = node_of_rank(status, 2)
    assert job.client.call("POST", "/v1/evict", {"node_id": victim, "reason": "operator"}) == {"ok": True}
    summary = job.finish()
    assert summary["evicted"] == [victim] and summary["layout"]["dp"] == 2, summary
    assert summary["faults"][0]["kind"] == "manual_evict"
    # dp=4 -> dp=2 resumes from a resharded checkpoint: same batches, another reduction order.
    ref_job, _ = reference
    assert job.losses() == pytest.approx(ref_job.losses(), rel=1e-4)
