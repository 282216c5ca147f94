"""A rank's progress as a tiny file its executor reads: no sockets, no torch, no locks.

Why a file: the executor must see the step of a rank that is hung or stopped, and must not
depend on the rank's cooperation to do so; the last write before the rank stopped is exactly
the information wanted. The file is replaced atomically, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STATUS_DIR_ENV = "MEGASCALE_STATUS_DIR"
RECENT = 16  # step times kept per file: a heartbeat every second sees every step


def status_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.json"


class StatusWriter:
    """Writes RANK's status after every step when the executor asked for it (env var set)."""

    def __init__(self, rank: int, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(STATUS_DIR_ENV)
        self.path = status_path(directory, rank) if directory else None
        self.rank = rank
        self.recent: list[list[float]] = []
        self.compute: list[list[float]] = []  # [step, seconds of the rank's own work]: the straggler rule's input
        self.last: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "step": None}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(
        self, step: int, step_time: float, start: dict[str, Any] | None = None, compute_s: float | None = None
    ) -> None:
        """`start`: when this rank joined its mesh and had its state back (the driver's recovery phases);
        `compute_s`: the step's compute + optimizer self time from the timers (collective waits apart)."""
        if self.path is None:
            return
        self.recent = [*self.recent[-(RECENT - 1) :], [step, step_time]]
        if compute_s is not None:
            self.compute = [*self.compute[-(RECENT - 1) :], [step, compute_s]]
        self.last = {
            "rank": self.rank,
            "pid": os.getpid(),
            "step": step,
            "step_time": step_time,
            "recent": self.recent,
            "compute": self.compute,
            "start": start,
            "phase": "training",
        }
        self._replace({**self.last, "time": time.time()})

    def paused(self) -> None:
        """The rank dropped its process groups after a peer failed and waits for the next attempt."""
        if self.path is not None:
            self._replace({**self.last, "phase": "paused", "time": time.time()})

    def _replace(self, data: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)


def read_status(directory: str | Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads(status_path(directory, rank).read_text())
    except (OSError, ValueError):
        return None
