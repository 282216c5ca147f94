"""Straggler detection with robust statistics, and the rank x step heat map that shows it.

A rank is compared only with its peers: the other ranks of the same pipeline stage in the same
step (stages do different work; steps differ in length). Its *compute* time (self time of
compute spans, collective waits excluded) is divided by the peers' median (leaving itself out,
so that a pair of ranks still has a reference); it is slow in that step when the ratio exceeds
`threshold` and, in groups of three or more, its robust z-score (distance to the median in
units of 1.4826 x MAD) exceeds `z_min`, so that ordinary jitter in a tight group is not flagged.
A rank is a straggler when it is slow in at least `min_fraction` of the analysed steps:
MegaScale's culprits were machines that were ~10% slower all the time, not one-off hiccups.
"""

from __future__ import annotations

import bisect
import sqlite3
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from megascale.diagnostics.figures import save_figure
from megascale.diagnostics.store import query

_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    coords: dict[str, int]
    median_ratio: float  # compute / peers' median, median over steps
    slow_fraction: float  # share of analysed steps in which it was slow
    steps: int

    def describe(self) -> str:
        c = " ".join(f"{k}={v}" for k, v in self.coords.items())
        return (f"rank {self.rank} on {self.host} ({c}): compute {self.median_ratio:.2f}x its "
                f"stage peers' median, slow in {self.slow_fraction:.0%} of {self.steps} steps")

    def to_dict(self) -> dict:
        return asdict(self)


def compute_ratios(conn: sqlite3.Connection, warmup_steps: int = 1,
                   metric: str = "compute") -> list[dict]:
    """Per (step, rank): the metric, its stage peers' median and MAD, ratio and robust z."""
    if metric not in ("compute", "comm", "p2p", "data", "optimizer", "step_time"):
        raise ValueError(f"unknown metric {metric!r}")
    rows = query(conn, f"SELECT step, rank, host, pp, dp, tp, {metric} AS value FROM rank_steps "
                       "ORDER BY step, rank")
    steps = sorted({r["step"] for r in rows})
    keep = set(steps[warmup_steps:]) if len(steps) > warmup_steps else set(steps)
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        if r["step"] in keep and r["value"] is not None:
            groups.setdefault((r["step"], r["pp"]), []).append(r)
    out = []
    for members in groups.values():
        values = sorted(m["value"] for m in members)
        mad = statistics.median(abs(v - statistics.median(values)) for v in values)
        spread = _MAD_TO_SIGMA * mad if len(values) >= 3 else 0.0  # no spread from one peer
        for m in members:
            ref = _median_without(values, m["value"])
            ratio = m["value"] / ref if ref > 0 else 1.0
            z = (m["value"] - ref) / spread if spread > 0 else (99.0 if m["value"] > ref else 0.0)
            out.append(dict(m, median=ref, mad=mad, ratio=ratio, z=z, peers=len(members)))
    return out


def _median_without(ordered: list[float], value: float) -> float:
    """Median of the sorted `ordered` with one occurrence of `value` left out (its peers)."""
    if len(ordered) == 1:
        return value
    i = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(k: int) -> float:  # k-th element of `ordered` without position i
        return ordered[k] if k < i else ordered[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def find_stragglers(conn: sqlite3.Connection, threshold: float = 1.10, min_fraction: float = 0.5,
                    z_min: float = 3.0, warmup_steps: int = 1) -> list[Straggler]:
    """Ranks consistently slower in compute than their stage peers, slowest first."""
    per_rank: dict[int, list[dict]] = {}
    for r in compute_ratios(conn, warmup_steps):
        if r["peers"] >= 2:
            per_rank.setdefault(r["rank"], []).append(r)
    found = []
    for rank, rows in per_rank.items():
        slow = [r for r in rows if r["ratio"] > threshold and r["z"] > z_min]
        fraction = len(slow) / len(rows)
        if fraction >= min_fraction:
            first = rows[0]
            found.append(Straggler(
                rank=rank, host=first["host"],
                coords={"pp": first["pp"], "dp": first["dp"], "tp": first["tp"]},
                median_ratio=statistics.median(r["ratio"] for r in rows),
                slow_fraction=fraction, steps=len(rows)))
    return sorted(found, key=lambda s: -s.median_ratio)


def plot_heatmap(conn: sqlite3.Connection, path: str | Path, order: str = "host",
                 warmup_steps: int = 1) -> Path | None:
    """PNG of compute / stage median per rank (rows) and step (columns).

    `order="host"` groups rows by host (a slow machine shows as a band); `order="grid"` sorts by
    (pp, dp, tp) so a slow stage or replica shows. Returns None when there is nothing to draw.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    rows = compute_ratios(conn, warmup_steps)
    if not rows:
        return None
    key = ((lambda r: (r["host"], r["rank"])) if order == "host"
           else (lambda r: (r["pp"], r["dp"], r["tp"], r["rank"])))
    ranks = sorted({(key(r), r["rank"], r["host"], r["pp"], r["dp"], r["tp"]) for r in rows})
    steps = sorted({r["step"] for r in rows})
    index = {entry[1]: i for i, entry in enumerate(ranks)}
    col = {s: j for j, s in enumerate(steps)}
    grid = np.full((len(ranks), len(steps)), np.nan)
    for r in rows:
        grid[index[r["rank"]], col[r["step"]]] = r["ratio"]
    height = min(2 + 0.25 * len(ranks), 40)
    fig, ax = plt.subplots(figsize=(min(4 + 0.12 * len(steps), 24), height))
    positive = np.where(grid > 0, grid, np.nan)
    span = max(1.25, float(np.nanmax(np.maximum(positive, 1 / positive))))  # symmetric in log
    im = ax.imshow(positive, aspect="auto", cmap="RdBu_r", norm=LogNorm(1 / span, span),
                   interpolation="nearest",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, len(ranks) - 0.5, -0.5))
    if len(ranks) <= 128:
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"{h} r{rk} pp{p} dp{d} tp{t}" for _, rk, h, p, d, t in ranks],
                           fontsize=7)
    group_of = (lambda e: e[2]) if order == "host" else (lambda e: e[3])
    for i in range(1, len(ranks)):
        if group_of(ranks[i]) != group_of(ranks[i - 1]):
            ax.axhline(i - 0.5, color="black", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_title(f"compute time / stage median (rows by {order})")
    bar = fig.colorbar(im, ax=ax, label="ratio to peers' median")
    ticks: list[float] = []
    for v in (1.0, 1.1, 1 / 1.1, 1.25, 0.8, 1.5, 1 / 1.5, 2.0, 0.5, 4.0, 0.25, 8.0, 0.125):
        far = all(abs(np.log(v / t)) > 0.15 * np.log(span) for t in ticks)  # legible spacing
        if 1 / span <= v <= span and far:
            ticks.append(v)
    ticks.sort()
    bar.set_ticks(ticks, labels=[f"{v:.2g}x" for v in ticks])
    bar.minorticks_off()
    return save_figure(fig, path)
