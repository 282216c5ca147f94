"""One self-contained HTML report per run, plus its PNG figures and trace files.

Why one file with the images inlined: the report is copied off clusters and opened on laptops
without network access; it must need nothing but a browser. Everything in it is computed from
the store (`store.py`), so `--sql` answers any question the page does not.
"""

from __future__ import annotations

import base64
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from megascale.config.operations import DiagnosticsConfig
from megascale.diagnostics import hang, straggler, timeline
from megascale.diagnostics.figures import save_figure
from megascale.diagnostics.store import Collector, query
from megascale.diagnostics.timers import KINDS
from megascale.layout.grid import RankGrid


@dataclass
class Report:
    out_dir: Path
    html: Path
    stragglers: list[straggler.Straggler]
    hang: hang.HangAnalysis | None
    figures: dict[str, Path] = field(default_factory=dict)
    traces: dict[str, Path] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "html": str(self.html),
            "stragglers": [s.to_dict() for s in self.stragglers],
            "hang": self.hang.to_dict() if self.hang else None,
            "figures": {k: str(v) for k, v in self.figures.items()},
            "traces": {k: str(v) for k, v in self.traces.items()},
        }


def build_report(
    run_dir: str | Path,
    cfg: DiagnosticsConfig | None = None,
    out_dir: str | Path | None = None,
    grid: RankGrid | None = None,
    trace_steps: tuple[int, int] | None = None,
) -> Report:
    """Collect the run's files, analyse them and write RUN_DIR/report/ (or `out_dir`).

    `trace_steps` limits the timeline traces to a step range (they grow with the run).
    """
    cfg = cfg or DiagnosticsConfig()
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    collector = Collector(run_dir)
    try:
        collector.poll()
        conn = collector.conn
        found = straggler.find_stragglers(
            conn, cfg.straggler_threshold, cfg.straggler_min_fraction, warmup_steps=cfg.straggler_warmup_steps
        )
        figures: dict[str, Path] = {}
        warmup = cfg.straggler_warmup_steps
        ratios = straggler.compute_ratios(conn, warmup)
        aggregated = len({r["rank"] for r in ratios}) > straggler.MAX_ROWS
        for order in ("host", "grid"):
            if png := straggler.plot_heatmap(conn, out / f"heatmap_{order}.png", order, warmup):
                figures[f"heatmap_{order}"] = png
            if aggregated and (
                png := straggler.plot_heatmap(
                    conn, out / f"heatmap_{order}_detail.png", order, warmup, straggler.drilldown_ranks(ratios, order)
                )
            ):
                figures[f"heatmap_{order}_detail"] = png
        if (png := plot_breakdown(conn, out / "breakdown.png")) is not None:
            figures["breakdown"] = png
        if (png := plot_mfu(conn, out / "mfu.png")) is not None:
            figures["mfu"] = png
        traces = {g: timeline.write_trace(conn, out / f"trace_by_{g}.json", g, trace_steps) for g in ("pp", "host")}
        analysis = hang.analyse(run_dir, grid)
        if analysis is not None:
            figures["hang"] = hang.plot_hang(analysis, out / "hang.png")
            if (png := hang.plot_hang_detail(analysis, out / "hang_detail.png")) is not None:
                figures["hang_detail"] = png
            (out / "hang.json").write_text(json.dumps(analysis.to_dict(), indent=1, default=str))
        report = Report(out, out / "report.html", found, analysis, figures, traces)
        report.html.write_text(render_html(run_dir, report, conn))
        (out / "summary.json").write_text(json.dumps(report.summary(), indent=1))
        return report
    finally:
        collector.close()


BREAKDOWN_RANKS = 64  # past this many ranks the right panel has a bar per stage, not per rank


def plot_breakdown(conn: sqlite3.Connection, path: Path) -> Path | None:
    """Stacked bars: time per kind, averaged over ranks per step (left) and over steps per rank
    (per pipeline stage past `BREAKDOWN_RANKS` ranks: 12,288 bars per kind draw nothing legible)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ", ".join(f"AVG({k}) AS {k}" for k in KINDS)
    by_step = query(
        conn, f"SELECT step, {cols}, AVG(step_time) AS step_time FROM rank_steps GROUP BY step ORDER BY step"
    )
    if not by_step:
        return None
    (ranks,) = conn.execute("SELECT COUNT(DISTINCT rank) FROM spans").fetchone()
    right = "rank" if ranks <= BREAKDOWN_RANKS else "pp"
    by_right = query(
        conn, f"SELECT {right}, {cols}, AVG(step_time) AS step_time FROM rank_steps GROUP BY {right} ORDER BY {right}"
    )
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    for ax, rows, x in ((axes[0], by_step, "step"), (axes[1], by_right, right)):
        xs = [r[x] for r in rows]
        bottom = [0.0] * len(rows)
        for kind in KINDS:
            vals = [(r[kind] or 0.0) * 1e3 for r in rows]
            if any(vals):
                ax.bar(xs, vals, bottom=bottom, label=kind, width=0.8)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        idle = [max(0.0, (r["step_time"] or 0.0) * 1e3 - b) for r, b in zip(rows, bottom, strict=True)]
        ax.bar(xs, idle, bottom=bottom, label="untimed", width=0.8, color="#dddddd")
        if len(xs) <= 32:
            ax.set_xticks(xs)
        ax.set_xlabel("pp stage" if x == "pp" else x)
        ax.set_ylabel("ms")
    axes[0].set_title("step time by kind (mean over ranks)")
    axes[1].set_title(f"step time by kind (mean over steps{'' if right == 'rank' else ' and the stage'})")
    axes[1].legend(fontsize=8)
    return save_figure(fig, path)


def plot_mfu(conn: sqlite3.Connection, path: Path) -> Path | None:
    """MFU and throughput over steps from metrics.jsonl; None when there are no metrics."""
    rows = query(conn, "SELECT step, mfu, tokens_per_s, step_time, loss FROM metrics ORDER BY step")
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, key, label, scale in (
        (axes[0], "mfu", "MFU (%)", 100.0),
        (axes[1], "tokens_per_s", "tokens/s", 1.0),
        (axes[2], "loss", "loss", 1.0),
    ):
        pts = [(r["step"], r[key] * scale) for r in rows if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", linewidth=1)
        else:
            ax.text(0.5, 0.5, f"no {label} recorded", ha="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.set_title(label)
    return save_figure(fig, path)


# Every value reaches the page through Jinja2 with autoescaping: timer files, host names and
# analyses are data another process wrote, and none of it may become markup or script.
TEMPLATE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>megascale report</title>
<style>body{font-family:sans-serif;margin:2em;max-width:1500px}img{max-width:100%;border:1px solid #ccc}
li{margin:.2em 0}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}
</style></head><body>
<h1>megascale run report: {{ run_dir }}</h1>
<p>{{ stats.ranks }} ranks, {{ stats.steps }} steps,
mean step time {{ "%.1f" % ((stats.step_time or 0) * 1e3) }} ms.</p>
{% if hang %}<h2 id="hang">Hang analysis</h2><ul>{% for line in hang %}<li>{{ line }}</li>{% endfor %}</ul>
<img alt="hang topology" src="{{ figures.hang }}">{% endif %}
<h2 id="stragglers">Stragglers</h2>
{% if stragglers %}<ul>{% for line in stragglers %}<li>{{ line }}</li>{% endfor %}</ul>
{% else %}<p>No rank is consistently slower than its stage peers.</p>{% endif %}
{% if stages %}<h2>Where the time goes, per pipeline stage</h2><p>Share of the ranks' step time
(self time per kind; p2p waits are the pipeline bubble, comm the collectives).</p>
<table><tr><th>pp stage</th><th>ranks</th>{% for kind in kinds %}<th>{{ kind }}</th>{% endfor %}</tr>
{% for row in stages %}<tr><td>{{ row.pp }}</td><td>{{ row.ranks }}</td>
{% for share in row.shares %}<td>{{ "-" if share is none else "%.1f%%" % share }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endif %}
{% if recoveries %}<h2 id="recoveries">Recoveries</h2><p>Each fault the driver recovered from, the path it
took (in_place: healthy ranks stayed; restart: every rank restarted) and its phases in seconds.</p>
<table><tr><th>fault</th><th>where</th><th>path</th><th>self-check</th><th>restored from</th>
{% for phase in phases %}<th>{{ phase }}</th>{% endfor %}<th>total</th></tr>
{% for r in recoveries %}<tr><td>{{ r.kind }}</td><td>{{ r.where }}</td><td>{{ r.path }}</td><td>{{ r.check }}</td>
<td>{{ r.source }}</td>{% for v in r.spans %}<td>{{ v }}</td>{% endfor %}<td>{{ r.total }}</td></tr>{% endfor %}
</table>{% endif %}
{% if detections %}<h2 id="fail-slow">Fail-slow detections</h2><p>Nodes the driver found computing slower than
the ranks doing the same work (median per window of steps), what each cost the job's throughput (and MFU)
while it stayed, and what was done about it.</p>
<table><tr><th>kind</th><th>where</th><th>steps</th><th>ratio</th><th>compute ms</th><th>peers ms</th><th>cost</th>
<th>action</th><th>why</th><th>replacement s</th></tr>
{% for d in detections %}<tr><td>{{ d.kind }}</td><td>{{ d.where }}</td><td>{{ d.steps }}</td><td>{{ d.ratio }}</td>
<td>{{ d.compute_ms }}</td><td>{{ d.peers_ms }}</td><td>{{ d.cost }}</td><td>{{ d.action }}</td><td>{{ d.reason }}</td>
<td>{{ d.recovery_s }}</td></tr>{% endfor %}</table>{% endif %}
{% for title, src in pictures %}<h2>{{ title }}</h2><img alt="{{ title }}" src="{{ src }}">{% endfor %}
<h2>Timeline</h2><p>Chrome/Perfetto traces (open in ui.perfetto.dev or chrome://tracing):
{% for group, name in traces %}<a href="{{ name }}">by {{ group }}</a>{{ ", " if not loop.last }}{% endfor %}</p>
</body></html>"""
TITLES = {
    "heatmap_host": "Compute heat map, ranks by host",
    "heatmap_grid": "Compute heat map, ranks by pp/dp/tp",
    "heatmap_host_detail": "Drill-down: the ranks of the most deviant hosts",
    "heatmap_grid_detail": "Drill-down: the ranks of the most deviant tp groups",
    "hang_detail": "Hang drill-down: the stuck ranks' dp replicas",
    "breakdown": "Step-time breakdown",
    "mfu": "MFU over time",
}


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _stage_rows(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Share of step time per kind for each pipeline stage: p2p is the pipeline bubble."""
    cols = ", ".join(f"SUM({k}) AS {k}" for k in KINDS)
    rows = query(
        conn,
        f"SELECT pp, COUNT(DISTINCT rank) AS ranks, {cols}, "
        "SUM(step_time) AS step FROM rank_steps GROUP BY pp ORDER BY pp",
    )
    out = []
    for r in rows:
        parts = [r[k] or 0 for k in KINDS]
        parts.append((r["step"] or 0) - sum(parts))
        out.append(
            {"pp": r["pp"], "ranks": r["ranks"], "shares": [100 * v / r["step"] if r["step"] else None for v in parts]}
        )
    return out


RECOVERY_PHASES = ("detect", "stop", "decide", "replace", "restore", "first_step")


def _seconds(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def recovery_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The driver's recoveries (resilience/summary.json of a `megascale launch` run), as table rows."""
    try:
        faults = json.loads((run_dir / "resilience" / "summary.json").read_text()).get("faults", [])
    except (OSError, ValueError, AttributeError):
        return []
    rows = []
    for f in faults if isinstance(faults, list) else []:
        if not isinstance(f, dict):
            continue
        check = f.get("selfcheck") if isinstance(f.get("selfcheck"), dict) else {}
        where = f"rank {f['rank']}" if f.get("rank") is not None else f.get("node")
        rows.append(
            {
                "kind": f.get("kind"),
                "where": where,
                "path": f.get("path") or "-",
                "check": ("ran" if check.get("run") else "skipped") if check else "-",
                "source": f.get("restore_source") or "-",
                "spans": [_seconds(f.get(f"{p}_s")) for p in RECOVERY_PHASES],
                "total": _seconds(f.get("recovery_s")),
            }
        )
    return rows


def detection_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The driver's fail-slow detections (resilience/summary.json `stragglers`): the evidence, the
    share of throughput the node cost while it stayed, what was done, and the replacement's cost."""
    try:
        summary = json.loads((run_dir / "resilience" / "summary.json").read_text())
    except (OSError, ValueError):
        return []
    faults = {f.get("detected"): f for f in summary.get("faults", []) if isinstance(f, dict)}
    rows = []
    for d in summary.get("stragglers", []) if isinstance(summary, dict) else []:
        recovery = faults.get(d.get("time")) if d.get("action") == "replace" else None
        rows.append(
            {
                "kind": d.get("kind"),
                "where": d.get("node") or "every rank",
                "steps": "-".join(str(s) for s in d.get("steps", [])),
                "ratio": f"{d.get('ratio', 0):.2f}x",
                "compute_ms": f"{d.get('compute_s', 0) * 1e3:.1f}",
                "peers_ms": f"{d.get('peers_median_s', 0) * 1e3:.1f}",
                "cost": f"{d.get('cost', 0):.0%}",
                "action": d.get("action"),
                "reason": d.get("reason"),
                "recovery_s": _seconds((recovery or {}).get("recovery_s")),
            }
        )
    return rows


def render_html(run_dir: Path, report: Report, conn: sqlite3.Connection) -> str:
    (stats,) = query(
        conn,
        "SELECT COUNT(DISTINCT rank) AS ranks, COUNT(DISTINCT step) AS steps, "
        "AVG(step_time) AS step_time FROM rank_steps",
    )
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE).render(
        run_dir=str(run_dir),
        stats=stats,
        kinds=[*KINDS, "untimed"],
        stages=_stage_rows(conn),
        hang=report.hang.summary() if report.hang is not None else None,
        figures={k: _data_uri(v) for k, v in report.figures.items() if k == "hang"},
        stragglers=[s.describe() for s in report.stragglers],
        pictures=[(title, _data_uri(report.figures[key])) for key, title in TITLES.items() if key in report.figures],
        traces=[(group, path.name) for group, path in report.traces.items()],
        recoveries=recovery_rows(run_dir),
        phases=RECOVERY_PHASES,
        detections=detection_rows(run_dir),
    )
