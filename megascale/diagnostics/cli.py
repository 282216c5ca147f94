"""`megascale report RUN_DIR`: collect a run's diagnostics and write its HTML report.

With `--sql QUERY` it only collects and answers the query against the store (schema in
docs/troubleshooting.md), e.g. the slowest ranks' mean compute time:
  megascale report runs/x --sql "SELECT rank, host, AVG(compute) FROM rank_steps
                                 GROUP BY rank ORDER BY 3 DESC LIMIT 5"
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

from megascale.config import load_config
from megascale.config.fields import ConfigError
from megascale.diagnostics.report import build_report, detection_rows
from megascale.diagnostics.store import Collector
from megascale.layout.grid import RankGrid


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="the run directory (holds timers/, hang/)")
    parser.add_argument(
        "--config", type=Path, default=None, help="job config TOML (default: RUN_DIR/config.toml when present)"
    )
    parser.add_argument("--out", type=Path, default=None, help="report folder (RUN_DIR/report)")
    parser.add_argument(
        "--layout", default=None, metavar="PP,DP,TP", help="the rank grid, when the run's files do not record it"
    )
    parser.add_argument("--sql", default=None, help="run a query on the store and print rows")
    parser.add_argument("--header", action="store_true", help="with --sql: print column names")
    parser.add_argument(
        "--trace-steps", default=None, metavar="A:B", help="only steps A..B in the timeline traces (default: all)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        print(f"megascale report: {run_dir} is not a directory")
        return 2
    if args.sql:
        collector = Collector(run_dir)
        try:
            collector.poll()
            cursor = collector.conn.execute(args.sql)
            if args.header and cursor.description:
                print("\t".join(d[0] for d in cursor.description))
            for row in cursor:
                print("\t".join(str(v) for v in row))
        except sqlite3.Error as exc:
            print(f"megascale report: SQL error: {exc} (schema: docs/troubleshooting.md)")
            return 2
        finally:
            collector.close()
        return 0
    config_path = args.config or (run_dir / "config.toml")
    try:
        cfg = load_config(config_path if config_path.is_file() else None, args.overrides)
    except ConfigError as exc:
        print(f"megascale report: {exc}")
        return 2
    grid = None
    if args.layout:
        pp, dp, tp = (int(v) for v in args.layout.split(","))
        grid = RankGrid(pp, dp, tp)
    elif config_path.is_file():
        grid = RankGrid.of(cfg.parallel)
    steps = None
    if args.trace_steps:
        first, last = (int(v) for v in args.trace_steps.split(":"))
        steps = (first, last)
    report = build_report(run_dir, cfg.diagnostics, args.out, grid, steps)
    if args.json:
        print(json.dumps(report.summary(), indent=1))
        return 0
    if not report.figures.get("breakdown"):
        print(f"no timer records in {run_dir / 'timers'} (was diagnostics.timers off?)")
    if report.hang is not None:
        print("hang analysis:")
        for line in report.hang.summary():
            print("  " + line)
    for d in detection_rows(run_dir):
        print(
            f"fail-slow: {d['kind']} {d['where']} steps {d['steps']}: compute {d['compute_ms']} ms vs peers "
            f"{d['peers_ms']} ms ({d['ratio']}), cost {d['cost']} of throughput; {d['action']} ({d['reason']}); "
            f"replacement {d['recovery_s']} s"
        )
    if report.stragglers:
        print("stragglers:")
        for s in report.stragglers:
            print("  " + s.describe())
    else:
        print("no stragglers")
    print(f"report: {report.html}")
    return 0
