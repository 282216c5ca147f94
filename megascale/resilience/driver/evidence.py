"""What the diagnostics package can add to a fault or an alert: the hang analysis (which rank
is stuck, from the ranks' watchdog dumps) and the stragglers (ranks slower in compute than their
stage peers, from the per-rank timers).

Each runs in a child process: the diagnostics import torch, and seconds of import inside the
driver would hold up every heartbeat it must answer. Best effort: any failure yields nothing.
The driver hands such work to one `BackgroundQueue`: one worker thread, a bounded queue and a
minimum interval per kind, so alerts in a burst cost one torch-importing child at a time (each
~200 MB), not one each at once; what is refused is recorded without its evidence.
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("megascale.driver")
TIMEOUT_S = 120


class BackgroundQueue:
    """Work the driver must not do under its lock, run one item at a time in arrival order."""

    def __init__(self, depth: int = 4, min_interval_s: float = 30.0) -> None:
        self.min_interval_s = min_interval_s
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(depth)
        self._last: dict[str, float] = {}  # kind -> when its last item was taken
        self._idle = threading.Condition()
        self._pending = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._work, name="driver-background", daemon=True)
        self._thread.start()

    def submit(self, kind: str, work: Callable[[], None], limited: bool = True) -> bool:
        """Queue `work`; False (nothing queued) when the queue is full or, if `limited`, an item
        of this kind was taken less than `min_interval_s` ago."""
        now = time.monotonic()
        if limited and now - self._last.get(kind, -self.min_interval_s) < self.min_interval_s:
            self.refused += 1
            return False
        with self._idle:
            try:
                self._queue.put_nowait(work)
            except queue.Full:
                self.refused += 1
                return False
            self._pending += 1
        self._last[kind] = now
        return True

    def drain(self, timeout_s: float) -> bool:
        """Wait (never under the driver's lock) until every queued item ran; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _work(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work()
            except Exception:
                log.exception("background work failed")
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


def hang_evidence(run_dir: str | Path, layout: dict[str, int]) -> dict[str, Any] | None:
    return _child(["hang", str(run_dir), json.dumps(layout)])


def straggler_evidence(run_dir: str | Path, config_path: str | Path) -> list[dict[str, Any]]:
    return _child(["stragglers", str(run_dir), str(config_path)]) or []


def _child(args: list[str]) -> Any:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "megascale.resilience.driver.evidence", *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        log.warning("%s evidence unavailable: %s", args[0], exc)
        return None


def _hang(run_dir: str, layout: dict[str, int]) -> dict[str, Any] | None:
    from megascale.diagnostics.hang import analyse
    from megascale.layout.grid import RankGrid

    analysis = analyse(run_dir, RankGrid(layout["pp"], layout["dp"], layout["tp"], layout.get("cp", 1)))
    return None if analysis is None else {"stuck": analysis.stuck, "summary": analysis.summary()}


def _stragglers(run_dir: str, config_path: str) -> list[dict[str, Any]]:
    """The report's straggler analysis over the newest `2 x straggler_window_steps` steps of
    every rank (their step summaries' tails): what is slow now, at a cost flat in the run's
    length (the collector's ingest of every span took 31 s CPU at 12,288 ranks, 5 steps)."""
    from megascale.config import load_config
    from megascale.diagnostics.recent import recent_rank_steps
    from megascale.diagnostics.straggler import find_stragglers

    cfg = load_config(config_path)
    d = cfg.diagnostics
    rows = recent_rank_steps(run_dir, 2 * cfg.resilience.straggler_window_steps)
    found = find_stragglers(
        rows, d.straggler_threshold, d.straggler_min_fraction, warmup_steps=d.straggler_warmup_steps
    )
    return [dict(s.to_dict(), description=s.describe()) for s in found]


if __name__ == "__main__":
    kind, run_dir, extra = sys.argv[1:4]
    result = _hang(run_dir, json.loads(extra)) if kind == "hang" else _stragglers(run_dir, extra)
    print(json.dumps(result, default=str))
