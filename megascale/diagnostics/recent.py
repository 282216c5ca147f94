"""Every rank's newest steps, from the tail of its step summaries: the live straggler evidence.

Why not the collector: it ingests every span of the run into SQLite (1.5M rows for 5 steps at
12,288 ranks, 29 s of CPU), and the driver's question while a job trains -- which rank computes
slower than its peers *now* -- needs one row per rank per recent step. `Timers` appends such a
row per step to `timers/steps/rankNNNNN.jsonl` (the store's `rank_steps` row: per-kind self
time and the step's wall time); this reads only the last lines of each file, so a call costs
O(ranks x steps asked), whatever the run's length, and holds no state between calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TAIL_BYTES = 4096  # first read from a file's end: ~15 summary lines; doubled until enough


def tail_lines(path: Path, count: int) -> list[bytes]:
    """The last `count` complete lines of `path` (a line still being written is left out)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        chunk = TAIL_BYTES
        while True:
            start = max(0, size - chunk)
            f.seek(start)
            data = f.read(size - start)
            lines = data[: data.rfind(b"\n") + 1].splitlines()
            if start > 0:
                lines = lines[1:]  # it began mid-line
            if len(lines) >= count or start == 0:
                return lines[-count:] if count else []
            chunk *= 4


def recent_rank_steps(run_dir: str | Path, steps: int) -> list[dict[str, Any]]:
    """Rows shaped like the store's `rank_steps` view for the newest `steps` steps of the run:
    each rank's last `steps` summaries, kept where the step is among the newest `steps` any rank
    reached. A step number seen twice (an attempt redid it) keeps its latest row."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted((Path(run_dir) / "timers" / "steps").glob("rank*.jsonl")):
        for line in tail_lines(path, steps):
            try:
                row = json.loads(line)
                rows[(row["rank"], row["step"])] = row
            except (ValueError, KeyError, TypeError):
                continue  # a torn line from a killed rank
    if not rows:
        return []
    newest = max(step for _, step in rows)
    return [{"pp": 0, "dp": 0, "tp": 0, **row} for (_, step), row in sorted(rows.items()) if step > newest - steps]
