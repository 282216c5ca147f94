"""The diagnostics at MegaScale's size: 64 to 12,288 simulated ranks (issue 37 items 9-11).

Every rank's timer file (5 steps of 1F1B with two micro-batches, one rank 20% slower) and hang
dump (one rank SIGSTOPped in the gradient sync) are written by the real writers
(megascale.testing.simtraces), then each analyser runs on them as `megascale report` and the
driver's live evidence do: the live straggler evidence (the step summaries' tails), the
collector's ingest, the straggler analysis, the heat maps,
the breakdown, the two traces, the hang analysis and its figure. Each size runs in a fresh
process; per phase: CPU seconds (the machine is shared: wall time is mostly waiting) and the
peak RSS reached in it (the peak is reset between phases through /proc/self/clear_refs).

    .venv/bin/python bench/scale_diagnostics.py                # 64 and 1,024 ranks (~1 min)
    .venv/bin/python bench/scale_diagnostics.py --full         # + 12,288 (minutes; ~1.2 GB of files in the temp dir)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megascale.diagnostics import hang, recent, report, straggler, timeline  # noqa: E402
from megascale.diagnostics.store import Collector  # noqa: E402
from megascale.layout.grid import RankGrid  # noqa: E402
from megascale.testing.simtraces import TraceShape, write_hang_dumps, write_timer_files  # noqa: E402

GRIDS = {64: (8, 1, 8), 1024: (8, 16, 8), 12288: (8, 192, 8)}  # world: (pp, dp, tp)


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def one_size(world: int, steps: int, work: Path) -> dict:
    grid = RankGrid(*GRIDS[world])
    slow, stuck = grid.rank_of(3, grid.dp - 1, 5), grid.rank_of(5, grid.dp // 2, 2)
    shape = TraceShape(grid, steps=steps, slow_rank=slow)
    out: dict = {
        "world": world,
        "grid": dict(zip(("pp", "dp", "tp"), GRIDS[world], strict=True)),
        "steps": steps,
        "phases": {},
    }

    def phase(name: str, fn):
        _reset_peak()
        cpu, wall = time.process_time(), time.perf_counter()
        result = fn()
        out["phases"][name] = {
            "cpu_s": round(time.process_time() - cpu, 3),
            "wall_s": round(time.perf_counter() - wall, 3),
            "peak_rss_mb": round(_peak_mb(), 1),
        }
        return result

    out["spans"] = phase("write_timer_files", lambda: write_timer_files(work, shape))
    out["timer_files_mb"] = round(sum(p.stat().st_size for p in (work / "timers").glob("*.jsonl")) / 2**20, 1)
    # the driver's live straggler evidence (resilience/driver/evidence.py): the tails of the step summaries
    live = phase("live_evidence", lambda: straggler.find_stragglers(recent.recent_rank_steps(work, 16)))
    out["live_evidence_found"] = [s.rank for s in live]
    phase("write_hang_dumps", lambda: write_hang_dumps(work, grid, stuck))
    collector = Collector(work)
    phase("collect", collector.poll)
    conn = collector.conn
    found = phase("stragglers", lambda: straggler.find_stragglers(conn))
    out["stragglers_found"] = [s.rank for s in found]
    out["straggler_expected"] = slow
    figs = work / "report"
    for order in ("host", "grid"):
        phase(f"heatmap_{order}", lambda o=order: straggler.plot_heatmap(conn, figs / f"heat_{o}.png", o))
        if world > straggler.MAX_ROWS:  # the drill-down, as `megascale report` draws it
            phase(
                f"heatmap_{order}_detail",
                lambda o=order: straggler.plot_heatmap(
                    conn,
                    figs / f"heat_{o}_detail.png",
                    o,
                    ranks=straggler.drilldown_ranks(straggler.compute_ratios(conn), o),
                ),
            )
    phase("breakdown", lambda: report.plot_breakdown(conn, figs / "breakdown.png"))
    for group in ("pp", "host"):
        path = phase(f"trace_by_{group}", lambda g=group: timeline.write_trace(conn, figs / f"trace_{g}.json", g))
        out[f"trace_by_{group}_mb"] = round(path.stat().st_size / 2**20, 1)
    analysis = phase("hang_analysis", lambda: hang.analyse(work, grid))
    out["hang_stuck"], out["hang_expected"] = analysis.stuck, [stuck]
    phase("hang_plot", lambda: hang.plot_hang(analysis, figs / "hang.png"))
    phase("hang_detail", lambda: hang.plot_hang_detail(analysis, figs / "hang_detail.png"))
    collector.close()
    out["figure_kb"] = {p.name: round(p.stat().st_size / 1024) for p in figs.glob("*.png")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="also 12,288 ranks")
    ap.add_argument("--worlds", type=int, nargs="*", choices=sorted(GRIDS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/scale_diagnostics.json"))
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: one size, JSON on stdout
    args = ap.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory(prefix="scale_diag_") as tmp:
            print(json.dumps(one_size(args.one, args.steps, Path(tmp))))
        return
    worlds = args.worlds or ([64, 1024, 12288] if args.full else [64, 1024])
    sizes = []
    for world in worlds:
        load = os.getloadavg()[0]
        child = subprocess.run(
            [sys.executable, __file__, "--one", str(world), "--steps", str(args.steps)],
            capture_output=True,
            text=True,
            check=True,
        )
        sizes.append(dict(json.loads(child.stdout.strip().splitlines()[-1]), load_average=round(load, 1)))
        print(json.dumps(sizes[-1]["phases"]), flush=True)
    result = {
        "bench": "scale_diagnostics",
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "loaded": "shared 2-core machine, other work running: CPU seconds are the figure",
        "sizes": sizes,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
