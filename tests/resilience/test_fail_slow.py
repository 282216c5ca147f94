"""Fail-slow end to end: a node really slowed (a cgroup CPU quota on its processes) is named by
its peers' compute times, replaced by a spare in place, and the run ends with the fault-free
losses; ranks with +-20% jitter on every step are never named.

Slow (each job is ~1-2 minutes on 2 shared cores): `-m slow` selects them.
The quota is far below what any rank gets here (0.05 of a core for the node's two ranks,
against 0.1-0.5 a rank: 2 cores shared with other jobs; its executor is left alone); the test
then checks the slowdown the rule measured against the peers, not against a wall-clock figure,
so a loaded machine only changes by how much the node is slower.
"""

from __future__ import annotations

import json
import os

import pytest

from megascale.resilience.driver.slowdown import CpuQuota, cpu_quota_available, tree
from tests.resilience.jobs import PAUSE, max_step, node_of_rank

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(420)]  # detection bounds in steps: run alone

W, WINDOWS = 3, 2
STRAGGLER = (
    f"--resilience.straggler_window_steps={W}",
    f"--resilience.straggler_windows={WINDOWS}",
    "--resilience.straggler_action=replace",
)


@pytest.mark.skipif(cpu_quota_available() is not None, reason=f"{cpu_quota_available()}")
def test_a_node_slowed_by_a_cpu_quota_is_replaced_by_a_spare_and_the_losses_hold(job_factory, reference):
    ref_job, _ = reference
    job = job_factory(fault=PAUSE, spares=2, extra=STRAGGLER)
    job.start()
    status = job.wait_for(lambda s: max_step(s) >= 2)  # rank 0 sleeps 12 s after step 2: slow node1 now
    victim = node_of_rank(status, 2)
    with CpuQuota(f"megascale-failslow-{os.getpid()}", cores=0.05) as quota:
        assert quota.add(tree(status["nodes"][victim]["pid"])[1:]) >= 2  # its ranks (+ standby), not the executor
        slowed_from = max_step(job.status()) + 1
        summary = job.finish()
    fault = next(f for f in summary["faults"] if f["kind"] == "straggler")
    assert fault["node"] == victim and fault["path"] == "in_place", fault
    assert victim in summary["evicted"]
    named = next(d for d in summary["stragglers"] if d["kind"] == "straggler")
    assert named["node"] == victim and named["action"] == "replace"
    # the bound: named by the end of the WINDOWS-th window after the slowdown (+ the window it began in)
    assert named["steps"][1] <= slowed_from + WINDOWS * W + W - 1, (slowed_from, named)
    # measured against the peers, whose own work is a few ms a step: 10 ms vs 411 (40x) here. When
    # their waits for the slowed node inside the optimizer span counted as their work, the ratio
    # was 1.6-1.8x, near the 1.3 threshold: the node was named late, or never (stop 39)
    assert named["ratio"] > 3.0 and named["peers_median_s"] > 0, named
    assert job.losses() == ref_job.losses()


def test_jitter_on_every_rank_is_never_flagged(job_factory):
    jitter = ";".join(f"jitter:rank={r}:step=1:frac=0.2" for r in range(4))
    # the default windows (8 steps, 2 of them): 3-step windows named a node once at load ~20 here,
    # its ranks scheduled less than the others' for 6 steps. A wider model: at hidden 64 a rank's
    # own work is ~18 ms a step, shorter than one round of the loaded machine's scheduler, and one
    # rank's 16-step median read 41.5 ms (2.25x) at load ~15 with no fault.
    # A threshold of 1.6, not the default 1.3: CI's 2-core runner, with this test alone, read rank
    # 0 at 1.41x its peers for 16 steps (122 vs 86 ms): 1.11x from its own draws (its window median
    # of the sleep, seeded by rank, is 0.34 of its work against its peers' 0.21), the rest the
    # scheduling of 4 ranks, 4 executors and the driver on 2 cores; idle here it reads 1.17x. The
    # rule's statistics at 1.3 under this jitter are the soak's (test_straggler.py); this test is
    # the live path, where the slowed node reads >3x (above).
    extra = (
        "--resilience.straggler_action=replace",
        "--resilience.straggler_threshold=1.6",
        "--train.steps=40",
        "--model.hidden=256",
    )
    job = job_factory(fault=jitter, spares=2, extra=extra)
    job.start()
    summary = job.finish()
    # a job_slow alert (every rank slower alike, as the machine's load rises) names no node
    assert [d for d in summary["stragglers"] if d["kind"] == "straggler"] == [] and summary["restarts"] == 0
    for rank in range(4):  # the jitter was there: each rank slept a tenth of its work or more a step
        spans = [json.loads(line) for line in (job.run_dir / "timers" / f"rank{rank:05d}.jsonl").open()]
        slept = sum(s["self"] for s in spans if s["name"] == "injected_jitter")
        work = sum(s["self"] for s in spans if s["kind"] in ("compute", "optimizer")) - slept
        assert slept > 0.1 * work, (rank, slept, work)
