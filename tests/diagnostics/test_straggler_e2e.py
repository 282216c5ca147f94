"""A compute straggler on a real 4-process gloo run (pp=1, dp=2, tp=2) is named, with its host.

Rank 2 sleeps longer in its forward; its tp peer (rank 3) waits for it in the all-reduce, so
per-rank step times are all alike -- only compute kept apart from collective waits finds it.
"""

from __future__ import annotations

import json

import pytest

from megascale.cli import main
from megascale.diagnostics.report import build_report
from megascale.diagnostics.store import Collector, query

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory, workload_cls):
    run_dir = tmp_path_factory.mktemp("straggler")
    w = workload_cls(run_dir, (1, 2, 2), "--steps", "8", "--slow-rank", "2", "--slow-s", "0.03")
    try:
        w.wait(150)
    finally:
        w.kill()
    return run_dir


@pytest.mark.slow
def test_report_names_the_slow_rank_and_host(straggler_run) -> None:
    report = build_report(straggler_run)
    named = [(s.rank, s.host) for s in report.stragglers]
    assert named == [(2, "node1")], named
    assert report.stragglers[0].coords == {"pp": 0, "dp": 1, "tp": 0}
    assert report.stragglers[0].median_ratio > 1.5
    assert report.hang is None
    html = report.html.read_text()
    assert "rank 2 on node1" in html and "data:image/png;base64," in html
    for key in ("heatmap_host", "heatmap_grid", "breakdown", "mfu"):
        assert report.figures[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_times_alike_but_compute_differs(straggler_run) -> None:
    c = Collector(straggler_run)
    c.poll()
    rows = {
        r["rank"]: r
        for r in query(
            c.conn,
            "SELECT rank, AVG(compute) AS compute, AVG(comm) AS comm, "
            "AVG(step_time) AS step FROM rank_steps WHERE step > 0 GROUP BY rank",
        )
    }
    c.close()
    steps = [r["step"] for r in rows.values()]
    assert max(steps) / min(steps) < 1.3  # the straggler is invisible in step time ...
    assert rows[2]["compute"] > 1.5 * rows[3]["compute"]  # ... but not in compute
    assert rows[3]["comm"] > rows[2]["comm"] + 0.02  # its tp peer waits for it


def test_polling_twice_adds_nothing(straggler_run) -> None:
    c = Collector(straggler_run)
    c.poll()
    assert c.poll() == 0
    (n,) = c.conn.execute("SELECT COUNT(*) FROM spans WHERE kind = 'step'").fetchone()
    c.close()
    assert n == 4 * 8


def test_trace_one_track_per_rank(straggler_run) -> None:
    build_report(straggler_run)
    trace = json.loads((straggler_run / "report" / "trace_by_pp.json").read_text())
    events = trace["traceEvents"]
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(t for _, t in threads) == [0, 1, 2, 3]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert {e["cat"] for e in spans} >= {"compute", "comm", "data", "optimizer", "step"}


def test_cli_sql_and_report(straggler_run, capsys) -> None:
    assert (
        main(
            [
                "report",
                str(straggler_run),
                "--sql",
                "SELECT rank, host FROM rank_steps GROUP BY rank ORDER BY AVG(compute) DESC LIMIT 1",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.split() == ["2", "node1"]
    assert main(["report", str(straggler_run), "--diagnostics.straggler_threshold=1.2"]) == 0
    out = capsys.readouterr().out
    assert "rank 2 on node1" in out and "report.html" in out
