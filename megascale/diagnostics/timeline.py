"""Chrome/Perfetto trace of every rank, grouped by a parallel dimension.

Each group (a pipeline stage, a host, a dp replica or a tp index) is a trace *process* and each
rank a *thread* in it, so stacking the stages of a pipeline shows its bubbles (the p2p waits and
gaps of a stage while the others run) and the dp all-reduces line up across replicas. Open the
file in https://ui.perfetto.dev or chrome://tracing (both work offline once loaded).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

GROUPINGS = ("pp", "host", "dp", "tp")


def iter_events(conn: sqlite3.Connection, group_by: str = "pp", steps: tuple[int, int] | None = None) -> Iterator[dict]:
    """The trace's events one at a time, read from a cursor: a run's spans (millions at
    12,288 ranks) are never all in memory, only the names of its ranks and groups."""
    if group_by not in GROUPINGS:
        raise ValueError(f"group_by must be one of {GROUPINGS}, got {group_by!r}")
    where, params = _where(steps)
    origin = conn.execute(f"SELECT MIN(start) FROM spans {where}", params).fetchone()[0]
    if origin is None:
        return
    groups: dict[object, int] = {}
    named: set[int] = set()
    for s in conn.execute(f"SELECT * FROM spans {where} ORDER BY rank, start", params):
        key = s[group_by]
        if key not in groups:
            pid = len(groups)
            groups[key] = pid
            yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"{group_by} {key}"}}
            yield {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        pid = groups[key]
        if s["rank"] not in named:
            named.add(s["rank"])
            label = f"rank {s['rank']} {s['host']} pp{s['pp']} dp{s['dp']} tp{s['tp']}"
            yield {"ph": "M", "name": "thread_name", "pid": pid, "tid": s["rank"], "args": {"name": label}}
            yield {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": pid,
                "tid": s["rank"],
                "args": {"sort_index": s["rank"]},
            }
        name = f"step {s['step']}" if s["kind"] == "step" else s["name"]
        yield {
            "ph": "X",
            "name": name,
            "cat": s["kind"],
            "pid": pid,
            "tid": s["rank"],
            "ts": round((s["start"] - origin) * 1e6, 3),
            "dur": round(s["dur"] * 1e6, 3),
            "args": dict(json.loads(s["attrs"]), step=s["step"], self_s=s["self"]),
        }


def _where(steps: tuple[int, int] | None) -> tuple[str, tuple]:
    return ("WHERE step BETWEEN ? AND ?", steps) if steps is not None else ("", ())


def _other_data(conn: sqlite3.Connection, group_by: str, steps: tuple[int, int] | None) -> dict:
    where, params = _where(steps)
    origin = conn.execute(f"SELECT MIN(start) FROM spans {where}", params).fetchone()[0]
    return {"grouped_by": group_by, "origin_epoch_s": origin}


def build_trace(conn: sqlite3.Connection, group_by: str = "pp", steps: tuple[int, int] | None = None) -> dict:
    """The trace as a dict in the Chrome trace event format (complete 'X' events, in us)."""
    return {
        "traceEvents": list(iter_events(conn, group_by, steps)),
        "displayTimeUnit": "ms",
        "otherData": _other_data(conn, group_by, steps),
    }


def write_trace(
    conn: sqlite3.Connection, path: str | Path, group_by: str = "pp", steps: tuple[int, int] | None = None
) -> Path:
    """`build_trace`'s JSON written event by event (memory independent of the run's size)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write('{"traceEvents": [')
        sep = ""
        for event in iter_events(conn, group_by, steps):
            f.write(sep + json.dumps(event))
            sep = ", "
        f.write(f'], "displayTimeUnit": "ms", "otherData": {json.dumps(_other_data(conn, group_by, steps))}}}')
    return path
