"""Fail-slow: the node whose ranks compute slower than the ranks doing the same work.

Why not step time: in synchronous training every rank waits for the slowest, so step time says
the job is slow, never who. Each rank's *compute* time (its compute + optimizer timer spans'
self time; collective and p2p waits are apart, `diagnostics/timers.py`) does say it: the slow
rank computes longer, its peers wait longer. Peers are the ranks of the same pipeline stage
(the tp, cp and dp ranks that run the same layers) on *other* nodes: a node's own ranks share its
fault. Per heartbeat each rank's new (step, compute) pairs go into its open window; a window
of `straggler_window_steps` steps is reduced to one summary (median, MAD) and the values are
dropped, so the state is one open window plus the last summary per rank. A window is judged
once every rank has closed it: a rank is slow in it when its median exceeds the median of its
peers' medians by `straggler_threshold` and by more than its noise (3 MADs of the window, over
the square root of its steps); a node is slow when one of its ranks is. A node slow for
`straggler_windows` windows in a row is named, with its compute time, its peers' median and
the share of the job's throughput (and so MFU) it costs: 1 - peers' median / its median, the
time every other rank spends waiting for it when compute is the critical path. A median
reference means a slowdown shared by half the peers or more names nobody; when every rank
slows alike (against the attempt's first window) the rule says the cause is the job.
Pure logic over the heartbeats' numbers: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from megascale.config.operations import ResilienceConfig
from megascale.resilience.driver.rules import Finding

NOISE_Z = 3.0  # MADs (over sqrt(n)) a rank's median must also exceed its peers' by
KEEP = 3  # closed windows kept per rank while slower ranks' heartbeats catch up


@dataclass(frozen=True)
class Summary:
    """One rank's window: the median and MAD of its compute seconds over the steps seen."""

    window: int
    median: float
    mad: float
    steps: int


@dataclass
class _Rank:
    node: str
    stage: int
    window: int = -1  # the window being filled
    values: list[float] = field(default_factory=list)
    last_step: int = -1
    closed: dict[int, Summary] = field(default_factory=dict)  # the newest closed windows (KEEP at most)
    scale: float = 1.0  # the busiest replica's micro-batches over this rank's (uneven shares)


@dataclass(frozen=True)
class Detection:
    """A node (or, with node None, the whole job) slower than it should be, and the evidence."""

    kind: str  # straggler | job_slow
    node: str | None
    ranks: list[int]
    compute_s: float  # the node's slowest rank's median compute per step (job_slow: every rank's)
    peers_median_s: float  # its peers' median (job_slow: the attempt's first window)
    ratio: float
    windows: int
    steps: tuple[int, int]  # the first and last step of the windows that named it
    cost: float  # share of the job's throughput (and MFU) lost to it

    def describe(self) -> str:
        if self.kind == "job_slow":
            return (
                f"every rank's compute slowed alike, {self.ratio:.2f}x the attempt's first window "
                f"({self.compute_s * 1e3:.1f} vs {self.peers_median_s * 1e3:.1f} ms a step, steps "
                f"{self.steps[0]}-{self.steps[1]}): the cause is the job (data, model, a shared resource), "
                "not a node; nobody is replaced"
            )
        return (
            f"{self.node} (ranks {self.ranks}) computes {self.compute_s * 1e3:.1f} ms a step against its "
            f"peers' median {self.peers_median_s * 1e3:.1f} ms ({self.ratio:.2f}x) for {self.windows} "
            f"windows (steps {self.steps[0]}-{self.steps[1]}); it costs the job ~{self.cost:.0%} of its "
            "throughput and MFU"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(window: int, values: list[float]) -> Summary:
    med = statistics.median(values)
    return Summary(window, med, statistics.median(abs(v - med) for v in values), len(values))


def median_without(ordered: list[float], removed: list[float]) -> float:
    """`statistics.median` of the sorted `ordered` less `removed` (values drawn from it), with no
    copy: each removed value takes its own position in `ordered` (equal values, consecutive ones)
    and the middle of what is left is found by stepping over those positions."""
    cut: list[int] = []
    for v in sorted(removed):
        p = bisect.bisect_left(ordered, v)
        cut.append(max(p, cut[-1] + 1) if cut else p)  # an equal value took p already: the next one
    left = len(ordered) - len(cut)

    def kth(j: int) -> float:
        for p in cut:
            if p > j:
                break
            j += 1
        return ordered[j]

    return kth(left // 2) if left % 2 else (kth(left // 2 - 1) + kth(left // 2)) / 2


def _peer_references(members: list[tuple[str, Summary]]) -> dict[str, tuple[float, float] | None]:
    """Per node of a stage, the median of its peers' (other nodes') medians and MADs; None when
    the stage lives on one node, no one to compare with. One sort per stage: the peers of each
    node recomputed cost O(ranks x nodes), 6.6 s of CPU a window at 12,288 ranks in one stage."""
    medians = sorted(s.median for _, s in members)
    mads = sorted(s.mad for _, s in members)
    own: dict[str, list[Summary]] = {}
    for node, s in members:
        own.setdefault(node, []).append(s)
    return {
        node: (median_without(medians, [s.median for s in mine]), median_without(mads, [s.mad for s in mine]))
        if len(mine) < len(members)
        else None
        for node, mine in own.items()
    }


class StragglerRule:
    def __init__(self, threshold: float, windows: int, window_steps: int, warmup: int) -> None:
        self.threshold, self.windows, self.window_steps, self.warmup = threshold, windows, window_steps, warmup
        self.ranks: dict[int, _Rank] = {}
        self.first_step: int | None = None
        self.judged = -1  # the newest window judged
        self.closed_count: dict[int, int] = {}  # window -> ranks that closed it (KEEP windows at most)
        self.streak: dict[str, list[tuple[int, float, float, list[int]]]] = {}  # node -> its slow windows
        self.job_streak: list[tuple[int, float]] = []
        self.baseline: float | None = None

    def reset(self, rank_nodes: dict[int, str], layout: dict[str, int], scale: dict[int, float] | None = None) -> None:
        """A new attempt: `rank_nodes` maps each rank to its node; stage = rank // (dp * cp * tp)
        (the grid's order, `layout/grid.py`: a stage's tp, cp and dp ranks run the same layers).
        `scale`: per rank, the factor its compute times are judged at, when replicas run uneven
        micro-batch counts (`placement.compute_scale`): a rank with fewer is not its peers' norm."""
        per_stage = max(layout.get("dp", 1) * layout.get("cp", 1) * layout.get("tp", 1), 1)
        scale = scale or {}
        self.ranks = {r: _Rank(node, r // per_stage, scale=scale.get(r, 1.0)) for r, node in rank_nodes.items()}
        self.first_step, self.judged, self.baseline = None, -1, None
        self.closed_count = {}
        self.streak, self.job_streak = {}, []

    def _window_of(self, step: int) -> int:
        return (step - self.first_step - self.warmup) // self.window_steps

    def observe(self, rank: int, compute: list[tuple[int, float]]) -> None:
        """A heartbeat's (step, compute seconds) pairs of one rank; pairs seen before are skipped."""
        state = self.ranks.get(rank)
        if state is None:
            return
        for step, seconds in compute:
            if step <= state.last_step:
                continue
            state.last_step = step
            if self.first_step is None:
                self.first_step = step
            if step < self.first_step + self.warmup:
                continue
            window = self._window_of(step)
            if window != state.window:
                self._close(state)
                state.window = window
            state.values.append(float(seconds) * state.scale)
            if len(state.values) == self.window_steps:  # complete: close it now, not at the next step
                self._close(state)

    def _close(self, state: _Rank) -> None:
        if state.values:
            if state.window not in state.closed:
                self.closed_count[state.window] = self.closed_count.get(state.window, 0) + 1
            state.closed[state.window] = summarise(state.window, state.values)
            state.values = []
            for old in sorted(state.closed)[:-KEEP]:
                del state.closed[old]
            for old in [w for w in self.closed_count if w <= state.window - KEEP]:  # pruned by this rank
                del self.closed_count[old]

    def check(self) -> list[Detection]:
        """Judge, in order, each window every rank has closed (each window once). A tick costs
        O(KEEP) until a window is complete (a count per window, not a walk over every rank)."""
        out: list[Detection] = []
        for window in sorted(w for w, n in self.closed_count.items() if n >= len(self.ranks) > 0):
            del self.closed_count[window]
            if window > self.judged and all(window in r.closed for r in self.ranks.values()):
                self.judged = window
                out += self._judge(window)
        return out

    def _steps(self, first_window: int, last_window: int) -> tuple[int, int]:
        start = self.first_step + self.warmup
        return start + first_window * self.window_steps, start + (last_window + 1) * self.window_steps - 1

    def _judge(self, window: int) -> list[Detection]:
        out = []
        slow: dict[str, tuple[float, float, list[int]]] = {}
        stages: dict[int, list[tuple[str, Summary]]] = {}
        for state in self.ranks.values():
            stages.setdefault(state.stage, []).append((state.node, state.closed[window]))
        refs = {
            (stage, node): ref for stage, members in stages.items() for node, ref in _peer_references(members).items()
        }
        for rank, state in self.ranks.items():
            key = (state.stage, state.node)
            if refs[key] is None:
                continue
            ref, peer_mad = refs[key]
            mine = state.closed[window]
            noise = NOISE_Z * 1.4826 * max(mine.mad, peer_mad) / math.sqrt(mine.steps)
            if ref > 0 and mine.median > self.threshold * ref and mine.median - ref > noise:
                worst = slow.get(state.node)
                ranks = [*(worst[2] if worst else []), rank]
                if worst is None or mine.median / ref > worst[0] / worst[1]:
                    slow[state.node] = (mine.median, ref, ranks)
                else:
                    slow[state.node] = (worst[0], worst[1], ranks)
        for node in list(self.streak):
            if node not in slow:
                del self.streak[node]
        for node, (med, ref, ranks) in sorted(slow.items()):
            streak = self.streak.setdefault(node, [])
            streak.append((window, med, ref, sorted(ranks)))
            if len(streak) == self.windows:  # named once per run of slow windows
                med = statistics.median(s[1] for s in streak)
                ref = statistics.median(s[2] for s in streak)
                out.append(
                    Detection(
                        "straggler",
                        node,
                        streak[-1][3],
                        med,
                        ref,
                        med / ref,
                        len(streak),
                        self._steps(streak[0][0], window),
                        1 - ref / med,
                    )
                )
        out += self._judge_job(window)
        return out

    def _judge_job(self, window: int) -> list[Detection]:
        job = statistics.median(r.closed[window].median for r in self.ranks.values())
        if self.baseline is None:
            self.baseline = job
            return []
        if job <= self.threshold * self.baseline:
            self.job_streak = []
            return []
        self.job_streak.append((window, job))
        if len(self.job_streak) != self.windows:
            return []
        job = statistics.median(j for _, j in self.job_streak)
        return [
            Detection(
                "job_slow",
                None,
                sorted(self.ranks),
                job,
                self.baseline,
                job / self.baseline,
                len(self.job_streak),
                self._steps(self.job_streak[0][0], window),
                1 - self.baseline / job,
            )
        ]


def action_for(
    detection: Detection, action: str, spares: int, replaced_last_hour: int, max_per_hour: int
) -> tuple[str, str]:
    """What the driver does about a detection: ("replace" | "alert", why). Replacing is bounded:
    `max_evictions_per_hour`, and the last spare is kept for a node that dies (a dead node
    stops the job; a slow one only slows it)."""
    if detection.kind == "job_slow":
        return "alert", "the slowdown is shared by the peers: no node to replace"
    if action != "replace":
        return "alert", f"resilience.straggler_action = {action!r}"
    if replaced_last_hour >= max_per_hour:
        return "alert", (
            f"{replaced_last_hour} straggler(s) replaced in the last hour "
            f"(resilience.max_evictions_per_hour = {max_per_hour})"
        )
    if spares < 2:
        return "alert", f"{spares} spare(s): the last spare is kept for a node that fails outright"
    return "replace", "replaced by a spare in place (peer-memory restore)"


def straggler_findings(
    rule: StragglerRule, cfg: ResilienceConfig, store: Any, spares: int, attempt: int, step: int, now: float
) -> list[Finding]:
    """The driver's findings from the rule's new detections; each detection is a `straggler` event
    (the report's record: evidence, action, cost). A replacement is a fault (the in-place path)."""
    out = []
    for d in rule.check():
        replaced = sum(1 for e in store.events("straggler") if e.get("action") == "replace" and e["time"] > now - 3600)
        act, why = action_for(d, cfg.straggler_action, spares, replaced, cfg.max_evictions_per_hour)
        store.event("straggler", {**d.to_dict(), "action": act, "reason": why, "attempt": attempt, "step": step}, now)
        out.append(Finding(d.kind, "fault" if act == "replace" else "alert", f"{d.describe()}; {why}", d.node))
    return out


def straggler_rule(cfg: ResilienceConfig) -> StragglerRule:
    return StragglerRule(cfg.straggler_threshold, cfg.straggler_windows, cfg.straggler_window_steps, cfg.warmup_steps)
