"""Chrome/Perfetto trace of every rank, grouped by a parallel dimension.

Each group (a pipeline stage, a host, a dp replica or a tp index) is a trace *process* and each
rank a *thread* in it, so stacking the stages of a pipeline shows its bubbles (the p2p waits and
gaps of a stage while the others run) and the dp all-reduces line up across replicas. Open the
file in https://ui.perfetto.dev or chrome://tracing (both work offline once loaded).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from megascale.diagnostics.store import query

GROUPINGS = ("pp", "host", "dp", "tp")


def build_trace(conn: sqlite3.Connection, group_by: str = "pp",
                steps: tuple[int, int] | None = None) -> dict:
    """The trace as a dict in the Chrome trace event format (complete 'X' events, in us)."""
    if group_by not in GROUPINGS:
        raise ValueError(f"group_by must be one of {GROUPINGS}, got {group_by!r}")
    where, params = "", ()
    if steps is not None:
        where, params = "WHERE step BETWEEN ? AND ?", steps
    spans = query(conn, f"SELECT * FROM spans {where} ORDER BY rank, start", params)
    events: list[dict] = []
    if not spans:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    origin = min(s["start"] for s in spans)
    groups: dict[object, int] = {}
    named: set[int] = set()
    for s in spans:
        key = s[group_by]
        if key not in groups:
            pid = len(groups)
            groups[key] = pid
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"{group_by} {key}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                           "args": {"sort_index": pid}})
        pid = groups[key]
        if s["rank"] not in named:
            named.add(s["rank"])
            label = f"rank {s['rank']} {s['host']} pp{s['pp']} dp{s['dp']} tp{s['tp']}"
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": s["rank"],
                           "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": s["rank"],
                           "args": {"sort_index": s["rank"]}})
        name = f"step {s['step']}" if s["kind"] == "step" else s["name"]
        events.append({"ph": "X", "name": name, "cat": s["kind"], "pid": pid, "tid": s["rank"],
                       "ts": round((s["start"] - origin) * 1e6, 3),
                       "dur": round(s["dur"] * 1e6, 3),
                       "args": dict(json.loads(s["attrs"]), step=s["step"], self_s=s["self"])})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"grouped_by": group_by, "origin_epoch_s": origin}}


def write_trace(conn: sqlite3.Connection, path: str | Path, group_by: str = "pp",
                steps: tuple[int, int] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(build_trace(conn, group_by, steps)))
    return path
