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
import math
import sqlite3
import statistics
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megascale.diagnostics.figures import save_figure
from megascale.diagnostics.store import query

if TYPE_CHECKING:
    import numpy as np

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
        return (
            f"rank {self.rank} on {self.host} ({c}): compute {self.median_ratio:.2f}x its "
            f"stage peers' median, slow in {self.slow_fraction:.0%} of {self.steps} steps"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def compute_ratios(
    source: sqlite3.Connection | list[dict], warmup_steps: int = 1, metric: str = "compute"
) -> list[dict]:
    """Per (step, rank): the metric, its stage peers' median and MAD, ratio and robust z.
    `source`: the store, or rows shaped like its `rank_steps` view (`diagnostics/recent.py`)."""
    if metric not in ("compute", "comm", "p2p", "data", "optimizer", "step_time"):
        raise ValueError(f"unknown metric {metric!r}")
    if isinstance(source, list):
        rows = [dict(r, value=r.get(metric)) for r in source]
    else:
        sql = f"SELECT step, rank, host, pp, dp, tp, {metric} AS value FROM rank_steps ORDER BY step, rank"
        rows = query(source, sql)
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


def find_stragglers(
    source: sqlite3.Connection | list[dict],
    threshold: float = 1.10,
    min_fraction: float = 0.5,
    z_min: float = 3.0,
    warmup_steps: int = 1,
) -> list[Straggler]:
    """Ranks consistently slower in compute than their stage peers, slowest first."""
    per_rank: dict[int, list[dict]] = {}
    for r in compute_ratios(source, warmup_steps):
        if r["peers"] >= 2:
            per_rank.setdefault(r["rank"], []).append(r)
    found = []
    for rank, rows in per_rank.items():
        slow = [r for r in rows if r["ratio"] > threshold and r["z"] > z_min]
        fraction = len(slow) / len(rows)
        if fraction >= min_fraction:
            first = rows[0]
            found.append(
                Straggler(
                    rank=rank,
                    host=first["host"],
                    coords={"pp": first["pp"], "dp": first["dp"], "tp": first["tp"]},
                    median_ratio=statistics.median(r["ratio"] for r in rows),
                    slow_fraction=fraction,
                    steps=len(rows),
                )
            )
    return sorted(found, key=lambda s: -s.median_ratio)


MAX_ROWS = 256  # heat-map rows: at the 40-inch height cap each keeps >= 15 px
DRILL_GROUPS = 4  # hosts (or tp groups) drawn rank by rank in the drill-down


def heatmap_rows(rows: list[dict], order: str, cap: int = MAX_ROWS) -> list[tuple[str, list[int], object]]:
    """The heat map's rows as (label, ranks, separator group), in `order`.

    A row per rank up to `cap` ranks; beyond, a row per host (`order="host"`) or per tp group
    (pp, dp) (`order="grid"`), and past `cap` of those, runs of consecutive ones: the figure's
    height is capped, and at 12,288 ranks a row per rank would be a third of a pixel.
    """
    if order not in ("host", "grid"):
        raise ValueError(f"order must be 'host' or 'grid', got {order!r}")
    key = (lambda r: (r["host"], r["rank"])) if order == "host" else (lambda r: (r["pp"], r["dp"], r["tp"], r["rank"]))
    ranks = sorted({(key(r), r["rank"], r["host"], r["pp"], r["dp"], r["tp"]) for r in rows})
    if len(ranks) <= cap:
        return [(f"{h} r{rk} pp{p} dp{d} tp{t}", [rk], h if order == "host" else p) for _, rk, h, p, d, t in ranks]
    natural: dict[tuple, list[tuple]] = {}
    for e in ranks:
        natural.setdefault((e[2],) if order == "host" else (e[3], e[4]), []).append(e)
    per_row = -(-len(natural) // cap)
    out: dict[tuple, list[tuple]] = {}
    for i, (g, members) in enumerate(natural.items()):
        block = (i // per_row,) if order == "host" else (g[0], g[1] // per_row)
        out.setdefault(block, []).extend(members)
    labelled = []
    for members in out.values():
        if order == "host":
            hosts = sorted({m[2] for m in members})
            label = hosts[0] if len(hosts) == 1 else f"{hosts[0]}..{hosts[-1]}"
            sep: object = None
        else:
            dps = sorted({m[4] for m in members})
            label = f"pp{members[0][3]} dp{dps[0]}" + (f"..{dps[-1]}" if len(dps) > 1 else "")
            sep = members[0][3]
        labelled.append((label, [m[1] for m in members], sep))
    return labelled


def drilldown_ranks(rows: list[dict], order: str, groups: int = DRILL_GROUPS) -> list[int]:
    """The ranks of the `groups` hosts (or tp groups) whose most deviant rank deviates most
    from its peers (median over steps of |log ratio|): what the drill-down map shows."""
    per_rank: dict[int, list[float]] = {}
    where: dict[int, object] = {}
    for r in rows:
        per_rank.setdefault(r["rank"], []).append(abs(math.log(r["ratio"])) if r["ratio"] > 0 else 0.0)
        where[r["rank"]] = r["host"] if order == "host" else (r["pp"], r["dp"])
    worst: dict[object, float] = {}
    for rank, devs in per_rank.items():
        worst[where[rank]] = max(worst.get(where[rank], 0.0), statistics.median(devs))
    chosen = set(sorted(worst, key=lambda g: -worst[g])[:groups])
    return sorted(r for r in per_rank if where[r] in chosen)


def heatmap_matrix(rows: list[dict], order: str) -> tuple[list[tuple[str, list[int], object]], list[int], np.ndarray]:
    """(rows as `heatmap_rows` makes them, steps, ratio per row and step): a row's value is the
    ratio of its most deviant rank in that step (largest |log ratio|)."""
    import numpy as np

    lines = heatmap_rows(rows, order)
    steps = sorted({r["step"] for r in rows})
    rank_ids = sorted({r["rank"] for r in rows})
    index = {rk: i for i, rk in enumerate(rank_ids)}
    col = {s: j for j, s in enumerate(steps)}
    logs = np.full((len(rank_ids), len(steps)), np.nan)
    for r in rows:
        if r["ratio"] > 0:
            logs[index[r["rank"]], col[r["step"]]] = np.log(r["ratio"])
    grid = np.full((len(lines), len(steps)), np.nan)
    for i, (_, members, _) in enumerate(lines):
        sub = logs[[index[m] for m in members]]
        deviation = np.where(np.isnan(sub), -1.0, np.abs(sub))
        grid[i] = np.exp(sub[deviation.argmax(axis=0), np.arange(len(steps))])
    return lines, steps, grid


def plot_heatmap(
    conn: sqlite3.Connection,
    path: str | Path,
    order: str = "host",
    warmup_steps: int = 1,
    ranks: Collection[int] | None = None,
) -> Path | None:
    """PNG of compute / stage median per rank (rows) and step (columns).

    `order="host"` groups rows by host (a slow machine shows as a band); `order="grid"` sorts by
    (pp, dp, tp) so a slow stage or replica shows. Past `MAX_ROWS` ranks a row is a host or tp
    group (or a run of them) showing its most deviant rank's ratio, so one slow rank still
    colours its row; `ranks` restricts the map to those (the drill-down). None when there is
    nothing to draw.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    rows = compute_ratios(conn, warmup_steps)
    if ranks is not None:
        keep = set(ranks)
        rows = [r for r in rows if r["rank"] in keep]
    if not rows:
        return None
    lines, steps, grid = heatmap_matrix(rows, order)
    aggregated = any(len(members) > 1 for _, members, _ in lines)
    height = min(2 + 0.25 * len(lines), 40)
    fig, ax = plt.subplots(figsize=(min(max(7, 4 + 0.12 * len(steps)), 24), height))
    span = max(1.25, float(np.nanmax(np.maximum(grid, 1 / grid))))  # symmetric in log
    im = ax.imshow(
        grid,
        aspect="auto",
        cmap="RdBu_r",
        norm=LogNorm(1 / span, span),
        interpolation="nearest",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(lines) - 0.5, -0.5),
    )
    every = max(1, len(lines) // 128)
    ax.set_yticks(range(0, len(lines), every))
    ax.set_yticklabels([lines[i][0] for i in range(0, len(lines), every)], fontsize=7)
    for i in range(1, len(lines)):
        if lines[i][2] is not None and lines[i][2] != lines[i - 1][2]:
            ax.axhline(i - 0.5, color="black", linewidth=0.8)
    ax.set_xlabel("step")
    what = "group: its most deviant rank" if aggregated else "rank"
    ax.set_title(f"compute / stage median, by {order}\n(a row per {what})", fontsize=10)
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
