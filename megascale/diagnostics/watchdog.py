"""Per-rank hang watchdog: when a span or a whole step runs past the timeout, say where we are.

Why a thread in the rank: when a collective hangs, every healthy rank of the job sits in it and
only the rank itself knows which call (op, group, sequence number) it is in. The watchdog reads
the open spans of `Timers` (no locks, no collectives), and writes RUN_DIR/hang/rank{r}.json once
per stuck step: the open spans, the innermost collective or p2p, coordinates, host, the Python
stacks of all threads, and Flight Recorder's record of the process groups when
TORCH_FR_BUFFER_SIZE is set. A rank that is stopped or dead writes nothing -- which is exactly
how the analyser (`hang.py`) finds it. Each rank also writes a roll call at start so the
analyser knows who should have reported.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megascale.diagnostics.timers import Timers
from megascale.layout.grid import RankGrid

WAIT_KINDS = ("comm", "p2p")
FLIGHT_RECORDER_ENTRIES = 2000  # collectives PyTorch's Flight Recorder keeps per process


def enable_flight_recorder() -> None:
    """Turn the Flight Recorder on for this process unless its environment sized it already;
    call it before the process groups exist (they read the size when they are made)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))


def hang_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "hang"


def roll_call_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "diagnostics" / "ranks"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def flight_recorder() -> dict[str, Any] | None:
    """A summary of PyTorch's Flight Recorder (gloo/NCCL) when it is recording, else None."""
    if not os.environ.get("TORCH_FR_BUFFER_SIZE"):
        return None
    try:
        import torch

        raw = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())
    except Exception as exc:  # a dump must never take the rank down
        return {"error": repr(exc)}
    entries = raw.get("entries", [])
    groups = {}
    for pg, status in raw.get("pg_status", {}).items():
        enqueued = int(status.get("last_enqueued_collective", -1))
        completed = int(status.get("last_completed_collective", -1))
        last = [e for e in entries if str(e.get("pg_id")) == pg]
        groups[pg] = {
            "last_enqueued": enqueued,
            "last_completed": completed,
            "pending": enqueued > completed,
            "last_op": last[-1].get("profiling_name") if last else None,
            "process_group": last[-1].get("process_group") if last else None,
        }
    return {"groups": groups, "entries": entries[-32:], "version": raw.get("version")}


class Watchdog:
    """Daemon thread that dumps this rank's state when it has been stuck for `timeout_s`."""

    def __init__(
        self,
        timers: Timers,
        run_dir: str | Path,
        timeout_s: float,
        grid: RankGrid | None = None,
        poll_s: float | None = None,
        on_hang: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.timers = timers
        self.run_dir = Path(run_dir)
        self.timeout_s = timeout_s
        self.grid = asdict(grid) if grid is not None else {}  # the layout the analyser places ranks on
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.05, timeout_s / 4))
        self.on_hang = on_hang
        self.path = hang_dir(run_dir) / f"rank{timers.rank}.json"
        self._stop = threading.Event()
        self._dumped_for: object = object()
        self._thread = threading.Thread(target=self._loop, name="megascale-watchdog", daemon=True)

    def start(self) -> Watchdog:
        write_json(roll_call_dir(self.run_dir) / f"rank{self.timers.rank}.json", self._whoami())
        self._thread.start()
        return self

    def _whoami(self) -> dict[str, Any]:
        """Which rank this is, where, and on which layout: the roll call and every dump start so."""
        t = self.timers
        return {
            "rank": t.rank,
            "host": t.host,
            "pid": os.getpid(),
            "coords": t.coords,
            "grid": self.grid,
            "time": time.time(),
        }

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s * 4 + 1)

    def check(self) -> dict[str, Any] | None:
        """One look: the dump written if the rank is stuck now (and was not dumped for it)."""
        t = self.timers
        spans = t.current()
        stuck = [s for s in spans if s["age"] > self.timeout_s]
        step_age = t.step_age()
        if not stuck and not (t.last_step is not None and step_age > self.timeout_s):
            return None
        episode = t.last_step
        if episode == self._dumped_for:
            return None
        self._dumped_for = episode
        dump = self.snapshot(spans, step_age)
        write_json(self.path, dump)
        if self.on_hang is not None:
            self.on_hang(dump)
        return dump

    def snapshot(self, spans: list[dict[str, Any]], step_age: float) -> dict[str, Any]:
        t = self.timers
        innermost = spans[-1] if spans else None
        waiting = next((s for s in reversed(spans) if s["kind"] in WAIT_KINDS), None)
        if waiting is not None:
            reason = (
                f"{waiting['kind']} '{waiting['name']}' open for {waiting['age']:.1f} s (timeout {self.timeout_s} s)"
            )
        elif innermost is not None:
            reason = (
                f"{innermost['kind']} '{innermost['name']}' open for "
                f"{innermost['age']:.1f} s (timeout {self.timeout_s} s)"
            )
        else:
            reason = f"step not finished after {step_age:.1f} s (timeout {self.timeout_s} s)"
        return {
            **self._whoami(),
            "reason": reason,
            "last_step": t.last_step,
            "step_age_s": step_age,
            "calls": t.call_counts(),
            "waiting": waiting,
            "innermost": innermost,
            "open_spans": spans,
            "stacks": _stacks(),
            "flight_recorder": flight_recorder(),
        }

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # keep watching; a failed dump is reported on stderr
                traceback.print_exc()


def _stacks() -> dict[str, list[str]]:
    names = {th.ident: th.name for th in threading.enumerate()}
    me = threading.get_ident()
    return {
        f"{names.get(ident, ident)}": traceback.format_stack(frame)[-12:]
        for ident, frame in sys._current_frames().items()
        if ident != me
    }
