"""Effective training time ratio: the training time of the steps that count, over wall time.

A step counts once, with the duration of its last (kept) execution: a step run again after a
rollback to the last checkpoint is time lost to the fault, as is detection, stopping, the
self-check and the restart. Read from rank 0's metrics.jsonl, which every attempt appends to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
    return {"steps": len(steps), "steps_executed": executed, "train_s": useful, "wall_s": wall_s,
            "ettr": useful / wall_s if wall_s > 0 else 0.0}
