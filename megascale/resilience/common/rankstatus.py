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


class DeliveredSteps:
    """Which steps' (step, seconds) pairs the driver has had from this executor, per rank and
    list (`recent`, `compute`), so each heartbeat carries only newer ones. The driver uses each
    pair once; resending a rank's last 16 pairs of both lists every beat made the schema check
    most of the driver's work per heartbeat at 1,536 nodes. A heartbeat left unanswered
    delivered nothing: its pairs go again (as far back as the status file keeps them). A new
    attempt starts afresh (its steps may repeat the old attempt's after a restore)."""

    def __init__(self) -> None:
        self.attempt: int | None = None
        self.delivered: dict[tuple[int, str], int] = {}  # (rank, list) -> newest step answered
        self.sending: dict[tuple[int, str], int] = {}  # the same for the heartbeat being built

    def begin(self, attempt: int) -> None:
        """A heartbeat's report is being built (for `attempt`)."""
        if attempt != self.attempt:
            self.attempt, self.delivered = attempt, {}
        self.sending = {}

    def new(self, rank: int, kind: str, pairs: list[list[float]]) -> list[list[float]]:
        """The pairs of list `kind` (in step order) the driver has not had."""
        through = self.delivered.get((rank, kind), -1)
        out = [p for p in pairs if p[0] > through]
        if out:
            self.sending[(rank, kind)] = int(out[-1][0])
        return out

    def answered(self) -> None:
        """The heartbeat last built was answered: its pairs reached the driver."""
        self.delivered.update(self.sending)
        self.sending = {}
