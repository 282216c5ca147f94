"""Hang analysis: place every rank's watchdog dump on the 3D topology and name the stuck ranks.

When one rank stops, every rank that needs it ends up waiting in a collective or a p2p call,
and each of their watchdogs dumps what it waits in. The analyser builds a dependency graph:
a rank waiting in a collective of group G depends on the members of G that are not in the same
call (same op and sequence number); a rank in a pipeline send/recv depends on its peer. The
ends of those edges are the suspects: ranks that wrote no dump (stopped, dead, or stuck in
native code), ranks stuck outside any collective (an endless compute), and members of
a tp/dp group, not in the call its peer waits in, that have nevertheless gone further (entered
more collectives or p2p calls, or finished more steps): they skipped the call. The stuck ranks
are the suspects reached from every waiting rank, plus every rank that did not dump.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale.diagnostics.figures import save_figure
from megascale.diagnostics.watchdog import hang_dir, roll_call_dir
from megascale.layout.grid import DIMS, RankGrid

SAME_STAGE = ("tp", "dp")  # groups whose members run the same program


@dataclass
class RankState:
    rank: int
    coords: dict[str, int]
    host: str = "?"
    state: str = "silent"  # silent | waiting | busy | diverged
    call: dict[str, Any] | None = None  # kind, op, group, seq, peer of the waiting span
    detail: str = "wrote no dump: stopped, dead or blocked outside Python"
    depends_on: list[int] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)  # calls entered per "kind:group"
    last_step: int | None = None


@dataclass
class HangAnalysis:
    grid: RankGrid
    ranks: dict[int, RankState]
    stuck: list[int]

    @property
    def waiting(self) -> list[int]:
        return [r for r, s in self.ranks.items() if s.state == "waiting"]

    def summary(self) -> list[str]:
        lines = []
        for r in self.stuck:
            s = self.ranks[r]
            c = " ".join(f"{k}={v}" for k, v in s.coords.items())
            lines.append(f"STUCK rank {r} on {s.host} ({c}): {s.detail}")
        calls = Counter(_call_label(self.ranks[r].call) for r in self.waiting)
        for label, n in calls.most_common():
            lines.append(f"{n} rank(s) waiting in {label}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "grid": {"pp": self.grid.pp, "dp": self.grid.dp, "tp": self.grid.tp},
            "stuck": self.stuck,
            "summary": self.summary(),
            "ranks": {r: vars(s) for r, s in sorted(self.ranks.items())},
        }


def load_dumps(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    dumps = {}
    for path in sorted(hang_dir(run_dir).glob("rank*.json")):
        data = json.loads(path.read_text())
        dumps[int(data["rank"])] = data
    return dumps


def load_roll_call(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    return {
        int(d["rank"]): d
        for d in (json.loads(p.read_text()) for p in sorted(roll_call_dir(run_dir).glob("rank*.json")))
    }


def analyse(run_dir: str | Path, grid: RankGrid | None = None) -> HangAnalysis | None:
    """Analyse RUN_DIR/hang; None when no rank dumped (there was no hang)."""
    dumps = load_dumps(run_dir)
    if not dumps:
        return None
    roll = load_roll_call(run_dir)
    if grid is None:
        grid = _grid_of_run(run_dir, [*dumps.values(), *roll.values()])
    return analyse_dumps(grid, dumps, {r: d.get("host", "?") for r, d in roll.items()})


def _grid_of_run(run_dir: str | Path, records: list[dict[str, Any]]) -> RankGrid:
    """The layout from the dumps or roll call, else from the run's RUN_DIR/config.toml."""
    layout = next((d["grid"] for d in records if d.get("grid")), None)
    if layout:
        return RankGrid(int(layout["pp"]), int(layout["dp"]), int(layout["tp"]))
    config = Path(run_dir) / "config.toml"
    if config.is_file():
        from megascale.config import load_config

        p = load_config(config).parallel
        return RankGrid.of(p)
    raise ValueError(
        f"no grid in the hang dumps or roll call and no {config}; pass the layout (megascale report --layout PP,DP,TP)"
    )


def analyse_dumps(
    grid: RankGrid, dumps: dict[int, dict[str, Any]], hosts: dict[int, str] | None = None
) -> HangAnalysis:
    ranks = {r: RankState(r, grid.named_coords(r), (hosts or {}).get(r, "?")) for r in range(grid.world_size)}
    for r, dump in dumps.items():
        s = ranks[r]
        s.host = dump.get("host", s.host)
        s.calls = dump.get("calls", {})
        s.last_step = dump.get("last_step")
        waiting = dump.get("waiting")
        if waiting:
            attrs = waiting.get("attrs", {})
            s.state = "waiting"
            s.call = {
                "kind": waiting["kind"],
                "op": attrs.get("op", waiting["name"]),
                "group": attrs.get("group"),
                "seq": attrs.get("seq"),
                "peer": attrs.get("peer"),
                "ranks": attrs.get("ranks"),
            }
            s.detail = f"waiting in {_call_label(s.call)} for {waiting.get('age', 0):.0f} s"
        else:
            s.state = "busy"
            s.detail = f"not in any collective: {dump.get('reason', 'step overran')}"
    _mark_diverged(grid, ranks)
    shared: dict[tuple, list[int]] = {}  # one list per (group, call): linear at any dp size
    for s in ranks.values():
        if s.state == "waiting":
            point_to_point = s.call["kind"] == "p2p" and s.call.get("peer") is not None
            key = (_group_key(grid, s), _call_key(s.call))
            if point_to_point or key[0] is None:  # its own peer, or a group with no name
                s.depends_on = _dependencies(grid, ranks, s)
            else:
                if key not in shared:
                    shared[key] = _dependencies(grid, ranks, s)
                s.depends_on = shared[key]
    return HangAnalysis(grid, ranks, _stuck(ranks))


def _members(grid: RankGrid, s: RankState) -> list[int] | None:
    call = s.call or {}
    if call.get("ranks"):
        return [int(r) for r in call["ranks"]]
    group = call.get("group")
    if group == "world":
        return list(range(grid.world_size))
    if group in DIMS:
        return grid.group_of(s.rank, group)
    return None


_CALL_KEYS = ("kind", "op", "group", "seq")


def _call_key(call: dict) -> tuple:
    return tuple(call.get(k) for k in _CALL_KEYS)


def _same_call(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and all(a.get(k) == b.get(k) for k in _CALL_KEYS)


def _group_key(grid: RankGrid, s: RankState) -> tuple | None:
    """Names the group of `s`'s call without listing it (listing is O(group) per rank)."""
    call = s.call or {}
    if call.get("ranks"):
        return ("ranks", *sorted(int(r) for r in call["ranks"]))
    group = call.get("group")
    if group == "world":
        return ("world",)
    if group in DIMS:
        return (group, *(v for k, v in s.coords.items() if k != group))
    return None


def _ahead(m: RankState, behind: tuple[int | None, dict[str, int]]) -> bool:
    """Has `m` done something that a waiter running the same program has not done yet?
    `behind` is the least progress of those waiters: (fewest steps, fewest calls per key)."""
    last_step, calls = behind
    if m.last_step is not None and last_step is not None and m.last_step > last_step:
        return True
    return any(m.calls[k] > n for k, n in calls.items() if k in m.calls)


def _least_progress(waiters: list[RankState]) -> tuple[int | None, dict[str, int]]:
    steps = [w.last_step for w in waiters if w.last_step is not None]
    calls: dict[str, int] = {}
    for w in waiters:
        for k, n in w.calls.items():
            calls[k] = min(n, calls.get(k, n))
    return (min(steps) if steps else None), calls


def _mark_diverged(grid: RankGrid, ranks: dict[int, RankState]) -> None:
    """A member of a waiter's same-stage group (tp, dp) that is not in the call but has gone
    further than the waiter -- more calls entered, or more steps done -- skipped that call.
    The waiters of one call in one group are judged together: each member is looked at once
    per call, not once per waiter (12,288 ranks x dp 192 otherwise)."""
    calls: dict[tuple, list[RankState]] = {}
    for s in ranks.values():
        if s.state == "waiting" and s.call["kind"] == "comm" and s.call["group"] in SAME_STAGE:
            calls.setdefault((_group_key(grid, s), _call_key(s.call)), []).append(s)
    for waiters in calls.values():
        waiters = [w for w in waiters if w.state == "waiting"]  # not marked diverged since
        if not waiters:
            continue
        s, behind = waiters[0], _least_progress(waiters)
        for m in (ranks[r] for r in grid.group_of(s.rank, s.call["group"])):
            if m.state in ("waiting", "busy") and not _same_call(m.call, s.call) and _ahead(m, behind):
                m.state = "diverged"
                m.detail = (
                    f"went past {_call_label(s.call)}, which rank {s.rank} of its "
                    f"{s.call['group']} group waits in (skipped a collective?); now "
                    f"{m.detail}"
                )


def _dependencies(grid: RankGrid, ranks: dict[int, RankState], s: RankState) -> list[int]:
    if s.call["kind"] == "p2p" and s.call.get("peer") is not None:
        return [int(s.call["peer"])]
    members = _members(grid, s)
    if members is None:
        return []
    return [m for m in members if m != s.rank and not _same_call(ranks[m].call, s.call)]


def _stuck(ranks: dict[int, RankState]) -> list[int]:
    suspects = {r for r, s in ranks.items() if s.state != "waiting"}
    reached: dict[tuple[int, ...], frozenset[int]] = {}  # waiters with the same edges share it
    for s in ranks.values():
        if s.state != "waiting":
            continue
        start = tuple(s.depends_on)
        if start in reached:
            continue
        seen, todo, found = {s.rank}, list(start), set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in suspects:
                found.add(n)
            else:
                todo.extend(ranks[n].depends_on)
        reached[start] = frozenset(found)
    known = [found for found in reached.values() if found]
    common = set.intersection(*map(set, known)) if known else set()
    if not common and known:
        common = set.union(*map(set, known))
    silent = {r for r, s in ranks.items() if s.state == "silent"}
    return sorted(common | silent)


def _call_label(call: dict | None) -> str:
    if not call:
        return "?"
    where = f"peer {call['peer']}" if call.get("peer") is not None else f"group {call.get('group')}"
    return f"{call['kind']} {call['op']} ({where}) #{call.get('seq')}"


DETAIL_RANKS = 256  # ranks drawn cell by cell, labelled, with their wait arrows
COLOURS = {"waiting": "#9ecae1", "busy": "#fdae6b", "diverged": "#fdae6b", "silent": "#fcbba1", "stuck": "#de2d26"}


def plot_hang(analysis: HangAnalysis, path: str | Path) -> Path:
    """PNG: one panel per pipeline stage, a dp x tp grid of ranks coloured by state.

    Up to `DETAIL_RANKS` ranks each cell is labelled and the waits are arrows; beyond (12,288
    labelled cells are unreadable) one pixel-cell per rank, the stuck ones boxed, and
    `plot_hang_detail` draws their dp replicas in full.
    """
    if analysis.grid.world_size <= DETAIL_RANKS:
        return _plot_cells(analysis, path, list(range(analysis.grid.dp)))
    return _plot_overview(analysis, path)


def plot_hang_detail(analysis: HangAnalysis, path: str | Path) -> Path | None:
    """The drill-down at scale: the dp replicas holding stuck ranks, cell by cell; None when
    `plot_hang` already drew every rank so (or nothing is stuck)."""
    g = analysis.grid
    if g.world_size <= DETAIL_RANKS or not analysis.stuck:
        return None
    replicas = sorted({analysis.ranks[r].coords["dp"] for r in analysis.stuck})
    return _plot_cells(analysis, path, replicas[: max(1, DETAIL_RANKS // (g.pp * g.tp))], stages_as_rows=True)


def _legend(ax: Any, below: float) -> None:
    """The key of the state colours, under a figure (both hang figures use it)."""
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -below), ncol=5, fontsize=8)


def _state_of(analysis: HangAnalysis, rank: int) -> str:
    return "stuck" if rank in analysis.stuck else analysis.ranks[rank].state


def _plot_overview(analysis: HangAnalysis, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    g, gap = analysis.grid, 1
    names = list(COLOURS)
    cells = np.full((g.dp, g.pp * (g.tp + gap) - gap), np.nan)
    for r, s in analysis.ranks.items():
        cells[g.dp - 1 - s.coords["dp"], s.coords["pp"] * (g.tp + gap) + s.coords["tp"]] = names.index(
            _state_of(analysis, r)
        )
    fig, ax = plt.subplots(figsize=(min(4 + 0.12 * cells.shape[1], 30), min(3 + 0.06 * g.dp, 30)))
    ax.imshow(
        cells,
        cmap=ListedColormap(list(COLOURS.values())),
        vmin=-0.5,
        vmax=len(names) - 0.5,
        aspect="auto",
        interpolation="nearest",
        extent=(0, cells.shape[1], 0, g.dp),
    )
    for r in analysis.stuck[:64]:
        c = analysis.ranks[r].coords
        ax.add_patch(
            Rectangle(
                (c["pp"] * (g.tp + gap) + c["tp"] - 1.5, c["dp"] - 1.5),
                4,
                4,
                fill=False,
                edgecolor="black",
                linewidth=1.5,
            )
        )
    ax.set_xticks([p * (g.tp + gap) + g.tp / 2 for p in range(g.pp)], [f"pp {p}" for p in range(g.pp)])
    ax.set_ylabel(f"dp (0..{g.dp - 1}, bottom up); x: tp within each stage")
    _legend(ax, below=0.06)
    more = f" +{len(analysis.stuck) - 8} more" if len(analysis.stuck) > 8 else ""
    stuck = ", ".join(f"r{r}" for r in analysis.stuck[:8]) + more or "none found"
    ax.set_title(f"hang at {g.world_size} ranks: stuck {stuck} (boxed); the detail figure draws their replicas")
    return save_figure(fig, path)


def _plot_cells(analysis: HangAnalysis, path: str | Path, replicas: list[int], stages_as_rows: bool = False) -> Path:
    """The labelled drawing of the ranks in dp replicas `replicas`, with their wait arrows: a
    panel per stage side by side (x: tp, y: dp), or with `stages_as_rows` a row per stage of
    each replica (x: tp), which keeps tp8 pp8's 64 cells of one replica legible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    g = analysis.grid
    index = {d: i for i, d in enumerate(replicas)}
    gap = 1
    if stages_as_rows:
        width, height = g.tp, len(replicas) * (g.pp + gap) - gap
        headings = [
            (-0.3, height - 1 - i * (g.pp + gap) - p + 0.5, f"dp {d} pp {p}")
            for d, i in index.items()
            for p in range(g.pp)
        ]
    else:
        width, height = g.pp * (g.tp + gap) - gap, len(replicas)
        headings = [(p * (g.tp + gap) + g.tp / 2, height + 0.1, f"pp stage {p} (x: tp, y: dp)") for p in range(g.pp)]

    def place(c: dict[str, int]) -> tuple[int, int]:
        if stages_as_rows:
            return c["tp"], height - 1 - index[c["dp"]] * (g.pp + gap) - c["pp"]
        return c["pp"] * (g.tp + gap) + c["tp"], height - 1 - index[c["dp"]]

    fig, ax = plt.subplots(figsize=(min(3 + 2.2 * width, 30), min(2.5 + 1.4 * height, 30)))
    centre = {}
    for r, s in analysis.ranks.items():
        if s.coords["dp"] not in index:
            continue
        x, y = place(s.coords)
        ax.add_patch(
            Rectangle(
                (x + 0.05, y + 0.05),
                0.9,
                0.9,
                facecolor=COLOURS[_state_of(analysis, r)],
                edgecolor="black",
                linewidth=2 if r in analysis.stuck else 0.5,
            )
        )
        label = f"r{r} {s.host}\n{s.state}"
        if s.call:
            label += f"\n{s.call['op']}#{s.call.get('seq')}"
        ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=7)
        centre[r] = (x + 0.5, y + 0.5)
    edges = [(r, d) for r in centre for d in analysis.ranks[r].depends_on if d in centre][:400]
    for r, d in edges:
        ax.annotate(
            "",
            xy=centre[d],
            xytext=centre[r],
            arrowprops={
                "arrowstyle": "-|>",
                "color": "#333333",
                "alpha": 0.7,
                "lw": 1.0,
                "shrinkA": 18,
                "shrinkB": 18,
                "connectionstyle": "arc3,rad=0.25",
            },
        )
    for x, y, text in headings:
        ax.text(x, y, text, ha="right" if stages_as_rows else "center", va="center", fontsize=9)
    ax.set_xlim(-2.2 if stages_as_rows else -0.2, width + 0.2)
    ax.set_ylim(-0.6, height + 0.5)
    ax.set_axis_off()
    _legend(ax, below=0.02)
    stuck = ", ".join(f"r{r}" for r in analysis.stuck) or "none found"
    shown = "" if len(index) == g.dp else f" (dp replicas {', '.join(map(str, replicas))} of {g.dp})"
    ax.set_title(f"hang: stuck {stuck}; arrows: waits for{shown}")
    return save_figure(fig, path)
