"""Pure-logic tests of the analysers: store, straggler statistics, timeline, hang graph."""

from __future__ import annotations

import json
import random

from megascale.diagnostics.hang import analyse_dumps
from megascale.diagnostics.store import Collector, query
from megascale.diagnostics.straggler import find_stragglers
from megascale.diagnostics.timeline import build_trace
from megascale.layout.grid import RankGrid

GRID = RankGrid(pp=2, dp=2, tp=2)


def records(compute_of, steps: int = 10, grid: RankGrid = GRID) -> list[dict]:
    """Per rank and step: a compute span, a dp comm span after it, and the step row."""
    out = []
    for step in range(steps):
        t0 = 1000.0 + step
        for rank in range(grid.world_size):
            c = grid.coords(rank)._asdict()
            base = {"step": step, "rank": rank, "coords": c, "host": f"h{rank // 4}", "attrs": {}}
            comp = compute_of(rank, step)
            out += [
                dict(base, name="forward", kind="compute", start=t0, dur=comp, self=comp),
                dict(
                    base,
                    name="all_reduce",
                    kind="comm",
                    start=t0 + comp,
                    dur=0.5 - comp,
                    self=0.5 - comp,
                    attrs={"op": "all_reduce", "group": "dp"},
                ),
                dict(base, name="step", kind="step", start=t0, dur=0.5, self=0.0),
            ]
    return out


def store(tmp_path, recs):
    c = Collector(tmp_path)
    c.ingest(recs)
    return c


def test_straggler_among_stage_peers_with_noise(tmp_path) -> None:
    rng = random.Random(0)
    stage_cost = {0: 0.1, 1: 0.2}  # stages differ: never compared with each other

    def compute(rank, step):
        slow = 1.3 if rank == 6 and step % 5 else 1.0  # slow in 80% of the steps
        return stage_cost[GRID.coords(rank).pp] * slow * rng.uniform(0.97, 1.03)

    c = store(tmp_path, records(compute))
    found = find_stragglers(c.conn, threshold=1.1)
    assert [(s.rank, s.host, s.coords) for s in found] == [(6, "h1", {"pp": 1, "dp": 1, "tp": 0})]
    assert 1.2 < found[0].median_ratio < 1.4 and found[0].slow_fraction >= 0.7
    assert find_stragglers(c.conn, threshold=1.5) == []  # the threshold is honoured
    c.close()


def test_occasional_hiccups_are_not_stragglers(tmp_path) -> None:
    c = store(tmp_path, records(lambda r, s: 0.1 * (2.0 if s == r else 1.0)))
    assert find_stragglers(c.conn) == []
    c.close()


def test_rank_steps_view_and_partial_lines(tmp_path) -> None:
    (tmp_path / "timers").mkdir()
    path = tmp_path / "timers" / "rank00000.jsonl"
    lines = [json.dumps(r) for r in records(lambda r, s: 0.1, steps=2, grid=RankGrid(1, 1, 1))]
    path.write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])  # a line still being written
    c = Collector(tmp_path)
    assert c.poll() == 4
    with path.open("a") as f:
        f.write(lines[4][10:] + "\n" + lines[5] + "\n")
    assert c.poll() == 2 and c.poll() == 0
    rows = query(c.conn, "SELECT * FROM rank_steps ORDER BY step")
    assert [(r["step"], round(r["compute"], 3), round(r["comm"], 3), r["step_time"]) for r in rows] == [
        (0, 0.1, 0.4, 0.5),
        (1, 0.1, 0.4, 0.5),
    ]
    c.close()


def test_trace_groups_by_stage_and_host(tmp_path) -> None:
    c = store(tmp_path, records(lambda r, s: 0.1, steps=2))
    for group_by, n in (("pp", 2), ("host", 2), ("tp", 2)):
        trace = build_trace(c.conn, group_by)
        procs = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
        assert len(procs) == n
        threads = {e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert threads == set(range(8))
    json.dumps(trace)
    c.close()


def waiting(
    rank: int,
    op: str,
    group: str,
    seq: int,
    peer: int | None = None,
    kind: str = "comm",
    step: int = 3,
    calls: dict | None = None,
) -> dict:
    attrs = {"op": op, "group": group, "seq": seq} | ({"peer": peer} if peer is not None else {})
    span = {"name": op, "kind": kind, "attrs": attrs, "age": 400.0}
    return {
        "rank": rank,
        "host": f"h{rank // 4}",
        "waiting": span,
        "last_step": step,
        "calls": calls or {},
        "reason": "...",
    }


def test_silent_rank_is_stuck_not_its_waiters() -> None:
    # rank 5 (pp1 dp0 tp1) stopped: its tp peer 4 waits in tp all-reduce; stage 0 waits on p2p
    dumps = {4: waiting(4, "all_reduce", "tp", 7)}
    for r in (6, 7):
        dumps[r] = waiting(r, "all_reduce", "dp", 2)
    for r in range(4):
        dumps[r] = waiting(r, "recv", "pp", 9, peer=GRID.rank_of(1, *GRID.coords(r)[1:]), kind="p2p")
    a = analyse_dumps(GRID, dumps)
    assert a.stuck == [5]
    assert a.ranks[5].coords == {"pp": 1, "dp": 0, "tp": 1}
    assert "STUCK rank 5" in a.summary()[0]


def test_rank_busy_outside_collectives_is_stuck() -> None:
    dumps = {r: waiting(r, "all_reduce", "world", 4) for r in range(8) if r != 2}
    dumps[2] = {"rank": 2, "host": "h0", "waiting": None, "last_step": 3, "reason": "compute 'forward' open for 900 s"}
    a = analyse_dumps(GRID, dumps)
    assert a.stuck == [2] and a.ranks[2].state == "busy"


def test_rank_that_went_past_a_collective_is_diverged() -> None:
    dumps = {r: waiting(r, "all_reduce", "dp", 5, calls={"comm:dp": 5}) for r in range(8)}
    dumps[3] = waiting(3, "all_reduce", "dp", 6, calls={"comm:dp": 6})  # dp peer of rank 1
    a = analyse_dumps(GRID, dumps)
    assert a.stuck == [3] and a.ranks[3].state == "diverged"


def test_grid_from_the_runs_config(tmp_path) -> None:
    from megascale.config import dump_config, load_config
    from megascale.diagnostics.hang import analyse

    cfg = load_config(None, ["--parallel.pp=2", "--parallel.tp=2", "--model.layers=4"])
    dump_config(cfg, tmp_path / "config.toml")
    (tmp_path / "hang").mkdir()
    for r in (0, 1, 2):
        dump = waiting(r, "all_reduce", "tp", 3, calls={"comm:tp": 3})
        (tmp_path / "hang" / f"rank{r}.json").write_text(json.dumps(dump))
    a = analyse(tmp_path)
    assert (a.grid.pp, a.grid.dp, a.grid.tp) == (2, 1, 2) and a.stuck == [3]
