"""Effective training time ratio: the training time of the steps that count, over wall time.

A step counts once, with the duration of its last (kept) execution: a step run again after a
rollback to the last checkpoint is time lost to the fault, as is detection, stopping, the
self-check and the restart. Read from rank 0's metrics.jsonl, which every attempt appends to.
`job_summary` puts it beside the job's fault matrix: per fault, the path its recovery took and how
long each phase lasted (`recovery.py`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megascale.resilience.driver.recovery import recovery_phases
from megascale.resilience.driver.state import JobState, JobStore


def final_records(metrics_path: str | Path) -> dict[int, dict[str, Any]]:
    """The last record of every step (a re-executed step replaces the lost one)."""
    records: dict[int, dict[str, Any]] = {}
    path = Path(metrics_path)
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line torn by a killed rank
        if "step" in rec:
            records[int(rec["step"])] = rec
    return records


def ettr(metrics_path: str | Path, wall_s: float, up_to_step: int | None = None) -> dict[str, Any]:
    records = final_records(metrics_path)
    steps = [s for s in records if up_to_step is None or s <= up_to_step]
    executed = 0
    path = Path(metrics_path)
    if path.is_file():
        executed = sum(1 for line in path.read_text().splitlines() if '"step"' in line)
    useful = sum(float(records[s].get("step_time", 0.0)) for s in steps)
    return {
        "steps": len(steps),
        "steps_executed": executed,
        "train_s": useful,
        "wall_s": wall_s,
        "ettr": useful / wall_s if wall_s > 0 else 0.0,
    }


def job_summary(s: JobState, store: JobStore, steps: int) -> dict[str, Any]:
    wall = (s.finished or time.time()) - s.created
    events = store.events()
    hangs = {e["detected"]: e["analysis"] for e in events if e["event"] == "hang_analysis"}
    matrix = []
    for f in (e for e in events if e["event"] == "fault"):
        matrix.append(
            {
                "kind": f["kind"],
                "node": f.get("node"),
                "rank": f.get("rank"),
                "detail": f["detail"],
                "collateral": f.get("collateral", []),
                "also": f.get("also", []),
                "detected": f["detected"],
                "last_progress": f.get("last_progress"),
                **recovery_phases(f, events),
                **({"hang_analysis": hangs[f["detected"]]} if f["detected"] in hangs else {}),
            }
        )
    return {
        "job_id": s.job_id,
        "phase": s.phase,
        "reason": s.reason,
        "restarts": s.restarts,
        "attempts": s.attempt + 1,
        "evicted": s.evicted,
        "layout": s.layout,
        "faults": matrix,
        "alerts": [e for e in events if e["event"] == "alert"],
        "stragglers": [e for e in events if e["event"] == "straggler"],
        "ettr": ettr(Path(s.run_dir) / "metrics.jsonl", wall, steps),
    }
