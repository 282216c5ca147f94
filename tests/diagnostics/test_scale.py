"""The diagnostics at scale (issue 37 items 9-11), checked at a few hundred simulated ranks.

The files are written by the real Timers and Watchdog (megascale.testing.simtraces); costs are
this thread's CPU time, small and 8x larger side by side in one test, so a loaded machine
shifts both alike. bench/scale_diagnostics.py measures the same pieces at 12,288 ranks.
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc

import pytest

from megascale.diagnostics import hang, straggler, timeline
from megascale.diagnostics.report import build_report
from megascale.diagnostics.store import Collector
from megascale.layout.grid import RankGrid
from megascale.testing.simtraces import TraceShape, write_hang_dumps, write_timer_files

pytestmark = [pytest.mark.serial, pytest.mark.timeout(300)]  # CPU-cost ratios: run alone (scripts/test.sh)


def cpu(fn):
    """CPU seconds of `fn` with the cyclic GC off (its passes cost the whole heap, whatever
    `fn` does) and its result."""
    gc.collect()
    gc.disable()
    try:
        started = time.thread_time()
        result = fn()
        return time.thread_time() - started, result
    finally:
        gc.enable()


def test_collector_commits_once_per_poll(tmp_path) -> None:
    """A commit per rank file was a disk sync each: 12,288 of them outlasted the driver's
    120 s wait for straggler evidence. One poll, one transaction; the next poll adds nothing."""
    shape = TraceShape(RankGrid(pp=2, dp=2, tp=4), steps=2, micro_batches=1, slow_rank=3)
    spans = write_timer_files(tmp_path, shape)
    collector = Collector(tmp_path)
    statements: list[str] = []
    collector.conn.set_trace_callback(statements.append)
    assert collector.poll() == spans
    assert statements.count("COMMIT") == 1
    assert collector.poll() == 0
    (found,) = straggler.find_stragglers(collector.conn, warmup_steps=0)
    assert found.rank == 3 and found.host == shape.host(3)
    collector.close()


def test_analysers_cost_per_rank_is_flat_from_64_to_512_ranks(tmp_path) -> None:
    """dp grows 2 -> 16 (what grows on the way to 12,288): the collector, the straggler
    analysis, a streamed trace and the hang analysis cost per rank within 2x of the small
    job's (the hang graph was O(world x dp): every waiter scanned its whole dp group)."""
    costs = {}
    for dp in (2, 16):
        grid = RankGrid(pp=4, dp=dp, tp=8)
        run = tmp_path / f"dp{dp}"
        slow, stuck = grid.rank_of(1, dp - 1, 3), grid.rank_of(2, dp // 2, 5)
        write_timer_files(run, TraceShape(grid, steps=3, micro_batches=1, slow_rank=slow))
        write_hang_dumps(run, grid, stuck)
        collector = Collector(run)
        t_collect, _ = cpu(collector.poll)
        t_straggler, found = cpu(lambda c=collector: straggler.find_stragglers(c.conn))
        t_trace, _ = cpu(lambda c=collector, r=run: timeline.write_trace(c.conn, r / "t.json"))
        collector.close()
        dumps = hang.load_dumps(run)
        t_hang, analysis = cpu(lambda g=grid, d=dumps: hang.analyse_dumps(g, d))
        assert [s.rank for s in found] == [slow] and analysis.stuck == [stuck]
        costs[dp] = {"collect": t_collect, "stragglers": t_straggler, "trace": t_trace, "hang": t_hang}
    for piece in costs[2]:
        per_rank_ratio = costs[16][piece] / max(costs[2][piece], 1e-3) / 8
        assert per_rank_ratio < 2.0, (piece, costs)


def test_trace_memory_does_not_grow_with_the_run(tmp_path) -> None:
    """The trace is written from a cursor: 8x the spans, the same peak (the whole-run list of
    events was 509 MB per file at 12,288 ranks for 5 steps)."""
    peaks = {}
    for steps in (1, 8):
        run = tmp_path / f"s{steps}"
        write_timer_files(run, TraceShape(RankGrid(pp=2, dp=2, tp=8), steps=steps, micro_batches=1))
        collector = Collector(run)
        collector.poll()
        tracemalloc.start()
        path = timeline.write_trace(collector.conn, run / "trace.json")
        peaks[steps] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        collector.close()
        events = json.loads(path.read_text())["traceEvents"]
        assert sum(e["ph"] == "X" for e in events) == 32 * steps * 15
    assert peaks[8] < 1.5 * peaks[1], peaks


def test_heat_map_rows_at_12288_ranks_show_the_slow_rank() -> None:
    """At 12,288 ranks a row per rank is a third of a pixel at the height cap: rows become
    (runs of) hosts or tp groups coloured by their most deviant rank, at most MAX_ROWS."""
    grid, slow = RankGrid(pp=8, dp=192, tp=8), 9000
    rows = [
        {
            "step": step,
            "rank": r,
            "host": f"node{r // 8:05d}",
            **grid.coords(r)._asdict(),
            "ratio": (1.2 if r == slow else 1.0 + 0.01 * ((r * 7 + step) % 5 - 2)),
        }
        for step in (1, 2)
        for r in range(grid.world_size)
    ]
    for order in ("host", "grid"):
        lines, steps, matrix = straggler.heatmap_matrix(rows, order)
        assert len(lines) <= straggler.MAX_ROWS and steps == [1, 2]
        assert sorted(r for _, members, _ in lines for r in members) == list(range(grid.world_size))
        (row,) = [i for i, (_, members, _) in enumerate(lines) if slow in members]
        assert matrix[row].tolist() == pytest.approx([1.2, 1.2])
        assert (abs(matrix[[i for i in range(len(lines)) if i != row]] - 1) <= 0.021).all()
        drill = straggler.drilldown_ranks(rows, order)
        assert slow in drill and len(drill) == straggler.DRILL_GROUPS * 8


def test_report_past_256_ranks_aggregates_and_drills_down(tmp_path) -> None:
    """Past 256 ranks `megascale report` draws the aggregated maps plus their drill-downs and
    the hang overview plus the stuck rank's replica; the analyses still name the culprits."""
    grid = RankGrid(pp=2, dp=17, tp=8)
    slow, stuck = grid.rank_of(1, 11, 4), grid.rank_of(0, 5, 6)
    write_timer_files(tmp_path, TraceShape(grid, steps=3, micro_batches=1, slow_rank=slow))
    write_hang_dumps(tmp_path, grid, stuck)
    rep = build_report(tmp_path, grid=grid, trace_steps=(2, 2))
    assert [s.rank for s in rep.stragglers] == [slow] and rep.hang.stuck == [stuck]
    assert {
        "heatmap_host",
        "heatmap_grid",
        "heatmap_host_detail",
        "heatmap_grid_detail",
        "breakdown",
        "hang",
        "hang_detail",
    } <= set(rep.figures)
    html = rep.html.read_text()
    assert "Drill-down: the ranks of the most deviant hosts" in html and f"rank {slow}" in html
