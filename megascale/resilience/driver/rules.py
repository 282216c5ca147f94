"""Detection rules: heartbeats in, findings out. Pure logic over timestamps, no I/O.

A `Finding` of severity "fault" makes the driver stop the job, self-check and resume; an
"alert" is only recorded and surfaced (a slow node or a fall in traffic is worth a look, not a
restart). Every rule takes `now` explicitly so that it is tested without sleeping.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from megascale.config.operations import ResilienceConfig


@dataclass(frozen=True)
class Finding:
    kind: str  # abnormal_exit | error_keyword | heartbeat_lost | hang | traffic_zero | slow | traffic_fall
    severity: str  # fault | alert
    detail: str
    node: str | None = None
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def abnormal_exits(node: str, ranks: Iterable[dict[str, Any]]) -> list[Finding]:
    """A rank that ended with a non-zero code or a signal (exit code 0 is a finished rank)."""
    out = []
    for r in ranks:
        code = r.get("exitcode")
        if code not in (None, 0):
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            out.append(Finding("abnormal_exit", "fault", f"rank {r['rank']} on {node}: {how}", node, r["rank"]))
    return out


def error_lines(node: str, lines: Iterable[dict[str, Any]], keywords: list[str]) -> list[Finding]:
    """Log lines the executor matched against the keywords (re-checked here: config wins)."""
    out = []
    for line in lines:
        hit = next((k for k in keywords if k in line.get("text", "")), None)
        if hit:
            out.append(
                Finding(
                    "error_keyword",
                    "fault",
                    f"rank {line.get('rank')} on {node} logged {hit!r}: {line['text'][:200]}",
                    node,
                    line.get("rank"),
                )
            )
    return out


@dataclass
class HangRule:
    """No step progress while every rank lives. The window is learned: before `warmup` steps
    it is the start-up timeout (a slow first step is no hang); after, max(floor, factor x the
    longest step seen); after the last step (final save, teardown) the start-up timeout again."""

    startup_s: float
    floor_s: float
    factor: float
    warmup: int
    started: float = 0.0
    last_step: int = -1
    last_progress: float = 0.0
    steps_seen: int = 0
    first_step: int = 0
    max_step_time: float = 0.0
    total_steps: int = 1 << 62

    def reset(self, now: float) -> None:
        self.started = self.last_progress = now
        self.last_step, self.steps_seen, self.max_step_time = -1, 0, 0.0

    def observe(self, step: int, recent: Iterable[tuple[int, float]], now: float) -> None:
        """`step`: the job's newest step; `recent`: (step, seconds) pairs seen with it."""
        recent = list(recent)
        if step > self.last_step:
            if self.last_step < 0:  # this attempt's first step: the oldest the ranks remember
                self.first_step = min([step, *(s for s, _ in recent)])
            self.last_step, self.last_progress = step, now
            self.steps_seen = step - self.first_step + 1
        learned = [t for s, t in recent if s >= self.first_step + self.warmup]
        if learned:
            self.max_step_time = max(self.max_step_time, *learned)

    @property
    def window_s(self) -> float:
        if self.steps_seen <= self.warmup or self.last_step >= self.total_steps:
            return self.startup_s  # starting, or past the last step: saving and tearing down
        return max(self.floor_s, self.factor * self.max_step_time)

    def check(self, now: float, all_alive: bool) -> Finding | None:
        stalled = now - self.last_progress
        if not all_alive or stalled <= self.window_s:
            return None
        where = f"after step {self.last_step}" if self.last_step >= 0 else "before the first step"
        return Finding("hang", "fault", f"no step progress for {stalled:.1f} s {where} (window {self.window_s:.1f} s)")


@dataclass
class SlowRule:
    """Recent step times well above the baseline learned after warm-up: an alert only.

    Bounded whatever the run's length: only the attempt's earliest `warmup + baseline_steps`
    steps (the baseline is among them: at most `warmup` distinct steps precede it) and its
    newest `recent_steps` steps are kept, each with the slowest rank's time. Each observation
    and each check costs O(warmup + baseline_steps + recent_steps), never O(steps seen)."""

    factor: float
    warmup: int
    baseline_steps: int = 4
    recent_steps: int = 4
    early: dict[int, float] = field(default_factory=dict)  # the smallest steps seen
    late: dict[int, float] = field(default_factory=dict)  # the largest steps seen
    alerted: bool = False

    def reset(self) -> None:
        self.early.clear()
        self.late.clear()
        self.alerted = False

    @property
    def _first(self) -> int:
        """Warm-up counts from the attempt's first step (a resumed run starts past step 1)."""
        return min(self.early) + self.warmup if self.early else 0

    def observe(self, step: int, step_time: float) -> None:
        _keep(self.early, step, step_time, self.warmup + self.baseline_steps, largest=False)
        _keep(self.late, step, step_time, self.recent_steps, largest=True)

    @property
    def baseline(self) -> float | None:
        first = self._first
        steps = sorted(s for s in self.early if s >= first)[: self.baseline_steps]
        if len(steps) < self.baseline_steps:
            return None
        return statistics.median(self.early[s] for s in steps)

    def check(self) -> Finding | None:
        base = self.baseline
        recent = sorted(self.late)
        if base is None or recent[0] < self._first + self.baseline_steps:
            return None
        now = statistics.median(self.late[s] for s in recent)
        slow = now > self.factor * base
        fire = slow and not self.alerted
        self.alerted = slow
        if not fire:
            return None
        return Finding(
            "slow",
            "alert",
            f"steps {recent[0]}-{recent[-1]} take {now:.3f} s, {now / base:.1f}x the baseline {base:.3f} s",
        )


def _keep(kept: dict[int, float], step: int, seconds: float, size: int, largest: bool) -> None:
    """Add (step, seconds) to `kept`, the `size` smallest (or largest) steps seen, each with
    its slowest time; O(size)."""
    if step in kept:
        kept[step] = max(seconds, kept[step])
        return
    if len(kept) < size:
        kept[step] = seconds
        return
    edge = min(kept) if largest else max(kept)
    if (step > edge) if largest else (step < edge):
        del kept[edge]
        kept[step] = seconds


@dataclass
class TrafficRule:
    """One node's bytes over its watched interfaces. Zero for `window_s` while ranks run is a
    fault (a cut link); below `fall_ratio` of the running baseline is an alert."""

    node: str
    window_s: float
    fall_ratio: float
    last: tuple[float, int] | None = None
    baseline: float = 0.0  # bytes/s, moving average of healthy rates
    zero_since: float | None = None
    alerted: bool = False

    def reset(self) -> None:
        self.last, self.baseline, self.zero_since, self.alerted = None, 0.0, None, False

    def observe(self, total_bytes: int, now: float, running: bool) -> Finding | None:
        prev, self.last = self.last, (now, total_bytes)
        if prev is None or now <= prev[0] or not running:
            self.zero_since = None
            return None
        rate = max(total_bytes - prev[1], 0) / (now - prev[0])
        if self.baseline == 0.0:
            self.baseline = rate
            return None
        if rate == 0.0:
            self.zero_since = self.zero_since if self.zero_since is not None else prev[0]
            if now - self.zero_since >= self.window_s:
                return Finding(
                    "traffic_zero",
                    "fault",
                    f"no traffic on {self.node} for {now - self.zero_since:.1f} s "
                    f"(baseline {self.baseline / 1e3:.1f} kB/s)",
                    self.node,
                )
            return None
        self.zero_since = None
        if rate < self.fall_ratio * self.baseline:
            fire, self.alerted = not self.alerted, True
            if fire:
                return Finding(
                    "traffic_fall",
                    "alert",
                    f"traffic on {self.node} fell to {rate / 1e3:.1f} kB/s from {self.baseline / 1e3:.1f} kB/s",
                    self.node,
                )
            return None
        self.alerted = False
        self.baseline = 0.8 * self.baseline + 0.2 * rate
        return None


def interface_bytes(counters: dict[str, list[int]], watched: list[str]) -> int | None:
    """Sent + received over the watched interfaces (all but loopback when none are named)."""
    names = watched or [n for n in counters if n != "lo"]
    chosen = [counters[n] for n in names if n in counters]
    return sum(c[0] + c[1] for c in chosen) if chosen else None


def hang_rule(cfg: ResilienceConfig, total_steps: int) -> HangRule:
    return HangRule(cfg.startup_timeout_s, cfg.hang_floor_s, cfg.hang_factor, cfg.warmup_steps, total_steps=total_steps)


def slow_rule(cfg: ResilienceConfig) -> SlowRule:
    return SlowRule(cfg.slow_factor, cfg.warmup_steps)
