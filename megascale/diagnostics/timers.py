"""Always-on per-rank timers: spans around compute, collectives, p2p, data and optimizer.

Why: a compute straggler hides behind everyone else's collective waits unless compute is timed
apart from communication. Every span is buffered in memory and written once per step (one JSON
line per span) to `out_dir/timers/rank{rank:05d}.jsonl`, so the cost per span is a few
microseconds; the step's per-kind totals go to `timers/steps/` too, one line a step (the live
straggler evidence reads their tail, not the run's spans). On GPU a span records two CUDA
events on the current stream; they are read one step later (when the GPU has long finished
them), so the step's stream is never synchronised.
`data` spans stay on the host clock even on GPU: waiting for the loader is the host's time.

Accounting: per-kind totals use each span's *self time* -- the part of its interval not covered
by a nested span -- so a `comm` span inside a `compute` span (the wait of a collective issued in
backward) counts as communication, not compute.
"""

from __future__ import annotations

import heapq
import json
import os
import socket
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from megascale.config.private_files import open_private

KINDS = ("compute", "comm", "p2p", "data", "optimizer", "other")
_NULL = nullcontext()


class _Span:
    """One open interval. Host times are `time.perf_counter()`; CUDA events when on GPU."""

    __slots__ = ("timers", "name", "kind", "attrs", "start", "end", "ev_start", "ev_end", "thread")

    def __init__(self, timers: Timers, name: str, kind: str, attrs: dict[str, Any]) -> None:
        self.timers = timers
        self.name = name
        self.kind = kind
        self.attrs = attrs
        self.ev_start = self.ev_end = None
        self.end = 0.0

    def __enter__(self) -> _Span:
        t = self.timers
        self.thread = threading.get_ident()
        t._open.setdefault(self.thread, []).append(self)
        self.start = time.perf_counter()  # before the event: a bound used by gpu_origin()
        if t._cuda and self.kind != "data":  # a data wait is the host's: timed on the host
            self.ev_start = t._event()
            self.ev_start.record()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = time.perf_counter()
        t = self.timers
        if self.ev_start is not None:
            self.ev_end = t._event()
            self.ev_end.record()
        stack = t._open.get(self.thread)
        if stack:
            if stack[-1] is self:
                stack.pop()
            else:  # closed out of order (a generator, an exception path): still remove it
                stack.remove(self)
        t._closed.append(self)


class Timers:
    """Per-rank span recorder. Cheap when disabled: `span()` returns a shared null context."""

    def __init__(
        self,
        rank: int,
        coords: dict[str, int],
        host: str | None,
        out_dir: str | Path | None,
        enabled: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self.rank = rank
        self.coords = dict(coords)
        self.host = host or socket.gethostname()
        self.enabled = enabled
        self._cuda = bool(enabled and device is not None and torch.device(device).type == "cuda")
        self._open: dict[int, list[_Span]] = {}
        self._closed: list[_Span] = []
        self._recorded: list[tuple[str, str, float, float, dict[str, Any]]] = []
        self._seq: dict[tuple, int] = {}
        self.last_step: int | None = None  # the last step closed by end_step
        self.last_totals: dict[str, float] = {}  # what end_step last returned (the rank's status reads it)
        # perf_counter -> epoch seconds, so spans of different hosts share one time axis
        self._epoch = time.time() - time.perf_counter()
        self._step_start = time.perf_counter()
        self._pending: tuple[int, float, list[_Span], list] | None = None  # GPU: previous step
        self._pool: list[torch.cuda.Event] = []  # events are reused: creating one is a driver call
        self._anchor = self._new_anchor() if self._cuda else None
        self.path: Path | None = None
        self._file = self._steps = None
        if enabled and out_dir is not None:
            self.path = Path(out_dir) / "timers" / f"rank{rank:05d}.jsonl"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = os.fdopen(open_private(self.path), "a", buffering=1 << 16)  # kept open; never a link
            steps = step_summary_path(out_dir, rank)
            steps.parent.mkdir(exist_ok=True)
            self._steps = os.fdopen(open_private(steps), "a", buffering=1 << 12)

    # ---- recording -------------------------------------------------------------------------
    def span(self, name: str, kind: str = "compute", **attrs: Any) -> AbstractContextManager:
        """Time a block. Spans nest; nested comm/p2p time is subtracted from the enclosing span.

        Collective attrs by convention: `op`, `group` (a mesh dim such as "dp", or "world"),
        `peer` (p2p). A comm/p2p span without `seq` gets one counted per (kind, group, peer),
        so the hang analyser can tell which ranks are in the same collective call.
        """
        if not self.enabled:
            return _NULL
        if kind not in KINDS:
            raise ValueError(f"timer kind {kind!r} is not one of {KINDS}")
        if (kind == "comm" or kind == "p2p") and "seq" not in attrs:
            key = (kind, attrs.get("group"), attrs.get("peer"))
            attrs["seq"] = self._seq[key] = self._seq.get(key, 0) + 1
        return _Span(self, name, kind, attrs)

    def record(self, name: str, kind: str, start: float, end: float, **attrs: Any) -> None:
        """Add an interval timed elsewhere; `start`/`end` are `time.perf_counter()` values."""
        if not self.enabled:
            return
        if kind not in KINDS:
            raise ValueError(f"timer kind {kind!r} is not one of {KINDS}")
        self._recorded.append((name, kind, start, end, attrs))

    def current(self) -> list[dict[str, Any]]:
        """Open spans of every thread, outermost first (read by the hang watchdog thread)."""
        out = []
        now = time.perf_counter()
        for thread, stack in list(self._open.items()):
            for depth, s in enumerate(list(stack)):
                out.append(
                    {
                        "name": s.name,
                        "kind": s.kind,
                        "attrs": dict(s.attrs),
                        "start": self._epoch + s.start,
                        "age": now - s.start,
                        "depth": depth,
                        "thread": thread,
                    }
                )
        return out

    def call_counts(self) -> dict[str, int]:
        """Collectives and p2p calls entered so far, per "kind:group" (peers summed).

        Ranks that run the same program (tp and dp peers) have equal counts at equal points,
        so a peer with a higher count somewhere has passed a call the others wait in.
        """
        counts: dict[str, int] = {}
        for (kind, group, _peer), n in list(self._seq.items()):
            key = f"{kind}:{group}"
            counts[key] = counts.get(key, 0) + n
        return counts

    def step_age(self) -> float:
        """Seconds since the last `end_step` (or since construction)."""
        return time.perf_counter() - self._step_start

    # ---- step boundary ---------------------------------------------------------------------
    def end_step(self, step: int, end: float | None = None) -> dict[str, float]:
        """Close a step: write its spans, return per-kind self-time totals and `step` (wall s).

        `end` (a `time.perf_counter()` value, default now) is for steps timed elsewhere, like
        the intervals of `record()`: replayed or simulated ranks (megascale.testing.simtraces).
        On GPU the spans are resolved one step late (their events are complete by then), so
        the totals returned are those of the previous step (empty after the first step).
        """
        if not self.enabled:
            return {}
        now = time.perf_counter() if end is None else end
        closed, self._closed = self._closed, []
        recorded, self._recorded = self._recorded, []
        first = self._step_start
        if self.last_step is None and (closed or recorded):  # not the set-up before step one
            first = min([s.start for s in closed] + [r[2] for r in recorded])
        self.last_step = step
        wall = (first, now)
        self._step_start = now
        if not self._cuda:
            return self._emit(step, self._host_rows(closed, recorded), wall)
        previous, self._pending = self._pending, (step, wall, closed, recorded, self._anchor)
        self._anchor = self._new_anchor()
        return self._resolve(previous)

    def close(self) -> None:
        """Flush what is buffered (the last GPU step included) and close the file."""
        if self.enabled and self._cuda:
            previous, self._pending = self._pending, None
            self._resolve(previous)
        for f in (self._file, self._steps):
            if f is not None:
                f.close()
        self._file = self._steps = None

    # ---- internals -------------------------------------------------------------------------
    def _event(self) -> torch.cuda.Event:
        try:  # pop() is atomic: spans also open in autograd's thread (backward hooks)
            return self._pool.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True)

    def _new_anchor(self) -> tuple[torch.cuda.Event, float]:
        ev = self._event()
        host = time.perf_counter()
        ev.record()
        return ev, host

    def _host_rows(self, closed: list[_Span], recorded: list) -> list[tuple]:
        rows = [(s.name, s.kind, s.start, s.end, s.attrs) for s in closed]
        rows.extend(recorded)
        return rows

    def _resolve(self, pending: tuple | None) -> dict[str, float]:
        if pending is None:
            return {}
        step, wall, closed, recorded, (anchor, anchor_host) = pending
        timed = [s for s in closed if s.ev_start is not None]
        if timed:
            # finished long ago: these are the previous step's. One wait covers the events
            # recorded before the last one on the same stream; elapsed_time checks the rest.
            timed[-1].ev_end.synchronize()
        gpu = [(s, _elapsed(anchor, s.ev_start), _elapsed(s.ev_start, s.ev_end)) for s in timed]
        origin = gpu_origin(anchor_host, [(s.start, s.end, a, d) for s, a, d in gpu])
        rows = [(s.name, s.kind, origin + a, origin + a + d, s.attrs) for s, a, d in gpu]
        rows += [(s.name, s.kind, s.start, s.end, s.attrs) for s in closed if s.ev_start is None]
        for s in timed:
            self._pool += (s.ev_start, s.ev_end)
        self._pool.append(anchor)
        rows.extend(recorded)
        return self._emit(step, rows, wall)

    def _emit(self, step: int, rows: list[tuple], wall: tuple[float, float]) -> dict[str, float]:
        selfs = self_times([(r[2], r[3]) for r in rows])
        totals = dict.fromkeys(KINDS, 0.0)
        for (_, kind, _, _, _), own in zip(rows, selfs, strict=True):
            totals[kind] += own
        totals["step"] = wall[1] - wall[0]
        self.last_totals = totals
        if self._file is not None and rows:
            # the fields shared by every line are encoded once per step
            head = json.dumps({"step": step, "rank": self.rank, "coords": self.coords, "host": self.host})[:-1]
            dumps, epoch = json.dumps, self._epoch
            lines = [
                f'{head}, "name": {dumps(name)}, "kind": "{kind}", '
                f'"start": {epoch + start:.6f}, "dur": {end - start:.7f}, "self": {own:.7f}, '
                f'"attrs": {dumps(attrs, default=str) if attrs else "{}"}}}'
                for (name, kind, start, end, attrs), own in zip(rows, selfs, strict=True)
            ]
            lines.append(
                f'{head}, "name": "step", "kind": "step", "start": {epoch + wall[0]:.6f}, '
                f'"dur": {wall[1] - wall[0]:.7f}, "self": 0.0, "attrs": {{}}}}'
            )
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        if self._steps is not None and rows:
            row = {"step": step, "rank": self.rank, "host": self.host, **self.coords}
            row.update({k: round(totals[k], 7) for k in KINDS}, step_time=round(totals["step"], 7))
            self._steps.write(json.dumps(row) + "\n")
            self._steps.flush()
        return totals


def gpu_origin(anchor_host: float, spans: list[tuple[float, float, float, float]]) -> float:
    """Host time (perf_counter) at which the GPU ran the step's anchor event, without a sync.

    The anchor is recorded at host time `anchor_host` but runs when the GPU gets to it, later
    if the GPU is behind. No event can run before the host records it, so for a span with host
    times (start, end) and GPU offsets from the anchor (a, a + d), the anchor ran at or after
    start - a and end - (a + d). The largest bound is exact whenever the GPU had caught up with
    the host at some span boundary of the step -- after any host sync such as `loss.item()`.
    """
    bounds = [anchor_host]
    for start, end, a, d in spans:
        bounds += (start - a, end - a - d)
    return max(bounds)


def _elapsed(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
    """Seconds between two recorded events, waiting for `b` only if it is not done yet."""
    try:
        return a.elapsed_time(b) / 1e3
    except RuntimeError:  # recorded on another stream that is still behind
        b.synchronize()
        return a.elapsed_time(b) / 1e3


def self_times(intervals: list[tuple[float, float]]) -> list[float]:
    """Each interval's time not covered by a later-starting overlapping one (its nested spans).

    At every instant the time goes to the innermost open interval: the one that started last.
    Works for properly nested spans and for intervals recorded elsewhere that overlap loosely.
    """
    n = len(intervals)
    out = [0.0] * n
    if n == 0:
        return out
    points = []
    for i, (s, e) in enumerate(intervals):
        points.append((s, 1, i))
        points.append((max(e, s), 0, i))
    points.sort()
    heap: list[tuple[float, float, int]] = []  # (-start, end, index): innermost on top
    done = [False] * n
    last = points[0][0]
    for t, is_start, i in points:
        while heap and done[heap[0][2]]:
            heapq.heappop(heap)
        if heap and t > last:
            out[heap[0][2]] += t - last
        last = t
        if is_start:
            heapq.heappush(heap, (-intervals[i][0], intervals[i][1], i))
        else:
            done[i] = True
    return out


_current = Timers(rank=0, coords={}, host="", out_dir=None, enabled=False)


def set_timers(timers: Timers) -> None:
    """Make `timers` the process-wide one (the trainer does this once it knows its rank)."""
    global _current
    _current = timers


def step_summary_path(out_dir: str | Path, rank: int) -> Path:
    """A rank's one line per step: its per-kind self-time totals (the store's `rank_steps` row).
    Live readers take the tail of it (`diagnostics/recent.py`) instead of every span of the run."""
    return Path(out_dir) / "timers" / "steps" / f"rank{rank:05d}.jsonl"


def get_timers() -> Timers:
    """The process-wide timers; a disabled one until `set_timers` is called."""
    return _current
