"""Hang localisation on a real 4-process gloo run laid out pp=2, dp=1, tp=2.

One rank is stopped with SIGSTOP inside a step, or skips one tp all-reduce; the healthy ranks'
watchdogs dump what they wait in, and the analysis must name the faulty rank with its
coordinates -- and none of the ranks waiting for it.
"""

from __future__ import annotations

import json
import time

import pytest

from megascale.diagnostics.hang import analyse
from megascale.diagnostics.report import build_report

pytestmark = pytest.mark.timeout(180)


def wait_for_dumps(run_dir, ranks, timeout=90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((run_dir / "hang" / f"rank{r}.json").exists() for r in ranks):
            return
        time.sleep(0.2)
    pytest.fail(f"no hang dumps from ranks {ranks} after {timeout} s")


def test_sigstopped_rank_is_named(tmp_path, workload) -> None:
    w = workload(tmp_path, (2, 1, 2), "--stop-rank", "3", "--hang-timeout", "2", "--steps", "5")
    wait_for_dumps(tmp_path, [0, 1, 2])
    time.sleep(0.5)
    assert not (tmp_path / "hang" / "rank3.json").exists()
    analysis = analyse(tmp_path)
    assert analysis.stuck == [3]
    s = analysis.ranks[3]
    assert s.coords == {"pp": 1, "dp": 0, "tp": 1} and s.host == "node1"
    assert s.state == "silent"
    # its tp peer waits in the all-reduce, the first stage waits on the pipeline
    assert analysis.ranks[2].call["op"] == "all_reduce" and 3 in analysis.ranks[2].depends_on
    dump = json.loads((tmp_path / "hang" / "rank2.json").read_text())
    assert dump["waiting"]["attrs"]["group"] == "tp" and dump["coords"]["pp"] == 1
    assert dump["flight_recorder"]["groups"]  # gloo collectives recorded by PyTorch
    report = build_report(tmp_path)
    assert "STUCK rank 3 on node1 (pp=1 dp=0 tp=1)" in report.html.read_text()
    assert report.figures["hang"].read_bytes()[:4] == b"\x89PNG"
    w.kill()


def test_rank_that_skips_a_collective_is_named(tmp_path, workload) -> None:
    w = workload(tmp_path, (2, 1, 2), "--skip-rank", "2", "--hang-timeout", "2", "--steps", "5")
    wait_for_dumps(tmp_path, [0, 1, 2, 3])
    analysis = analyse(tmp_path)
    assert analysis.stuck == [2], analysis.summary()
    assert analysis.ranks[2].state == "diverged"
    assert analysis.ranks[2].coords == {"pp": 1, "dp": 0, "tp": 0}
    w.kill()
