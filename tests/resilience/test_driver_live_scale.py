"""A real driver process under 32 and then 256 simulated executors (real TLS, token, HTTP/1.1,
schemas, heartbeats of 8 ranks each: `megascale/testing/simnodes.py`): the driver's CPU per
heartbeat and per registration does not grow with the node count, one silent node is found as
fast among 256 as among 32, and no other fault is raised. CPU time from /proc, so a loaded
machine slows both sizes alike (bench/scale.py runs the same measurement up to 1,536 nodes).
"""

from __future__ import annotations

import pytest

from megascale.resilience.driver.api_server import raise_fd_limit
from megascale.testing.scale import run_size

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(400)]  # CPU-cost ratios: run alone


def test_per_heartbeat_work_does_not_grow_with_the_node_count():
    raise_fd_limit()
    small, big = run_size(32, window_s=6.0, extra=[]), run_size(256, window_s=6.0, extra=[])
    for row in (small, big):
        assert row["false_faults"] == 0 and row["faults_after_silence"] == [("heartbeat_lost", "sim00000")], row
        assert row["register_s"] < 60 and row["heartbeats"] > 0.5 * row["nodes"] * 6.0, row
        assert row["detect_silent_node_s"] is not None and row["detect_silent_node_s"] < 5.0 + 2.5, row
    assert big["driver_cpu_per_heartbeat_ms"] < 2.0 * small["driver_cpu_per_heartbeat_ms"] + 0.1, (small, big)
    assert big["driver_cpu_per_registration_ms"] < 2.0 * small["driver_cpu_per_registration_ms"] + 0.5, (small, big)
