"""`megascale selfcheck`: run the node and network self-checks by hand or for the executor.

By hand on one node: `megascale selfcheck --ranks 4`. With a neighbour: start
`megascale selfcheck --peer B --role 0 --master A_ADDR --port P` on A and `--role 1` on B.
`--measure FILE` records the figures measured here as the healthy baseline of this node's
hardware type in FILE (other types' baselines are kept) for `resilience.selfcheck_expected`:
later checks fail a figure below `--min-ratio` of it. `--judge A.json B.json ...` compares
the reports (`--json` output) of nodes checked together with each other, as the driver does.
The executor passes the driver's plan as JSON (`--plan`).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from megascale.config.operations import ResilienceConfig
from megascale.resilience.selfcheck.checks import record_baseline, run_checks
from megascale.resilience.selfcheck.verdict import judge


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-id", default=socket.gethostname())
    parser.add_argument("--address", default="127.0.0.1", help="this node's address (reporting only)")
    parser.add_argument("--ranks", type=int, default=2, help="processes in the node's all-to-all")
    parser.add_argument("--expected", default="", help="JSON file of expected figures")
    parser.add_argument("--peer", help="neighbour node name for the pair tests")
    parser.add_argument("--role", type=int, choices=(0, 1), default=0, help="0 hosts the pair rendezvous")
    parser.add_argument("--master", help="address of the role-0 node")
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--plan", help="the driver's plan as JSON (overrides the options above)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--measure", help="record the figures measured here as this hardware's baseline in FILE")
    parser.add_argument(
        "--min-ratio",
        type=float,
        default=ResilienceConfig().selfcheck_min_ratio,
        help="a figure below this share of its peers' median (or its baseline) fails",
    )
    parser.add_argument("--judge", nargs="+", metavar="REPORT", help="compare nodes' JSON reports with each other")


def run(args: argparse.Namespace) -> int:
    if args.judge:
        return judge_files(args.judge, args.min_ratio)
    if args.plan:
        plan = json.loads(args.plan)
    else:
        pairs = [{"peer": args.peer, "role": args.role, "master": args.master, "port": args.port}] if args.peer else []
        plan = {"ranks": args.ranks, "expected_file": args.expected, "pairs": pairs, "min_ratio": args.min_ratio}
    report = run_checks(args.node_id, plan)
    if args.measure:
        record_baseline(args.measure, report)
        print(f"recorded {report['node']}'s figures as the baseline of {report['hardware']} in {args.measure}")
    if args.json:
        print(json.dumps(report))
    else:
        for t in report["tests"]:
            peer = f" with {t['peer']}" if "peer" in t else ""
            status = "ok  " if t["passed"] else "FAIL"
            detail = t.get("error") or f"{t['value']:.3g} {t['unit']} (expected >= {t['expected']:.3g})"
            print(f"{status} {args.node_id} {t['name']}{peer}: {detail}")
        print(f"{args.node_id}: {'PASSED' if report['passed'] else 'FAILED: ' + '; '.join(report['failed'])}")
    sys.stdout.flush()
    return 0 if report["passed"] else 1


def judge_files(paths: list[str], min_ratio: float) -> int:
    """The verdict over reports of nodes checked together; exit code 1 when one fails."""
    results = {}
    for path in paths:
        try:
            report = json.loads(Path(path).read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError) as exc:
            print(f"megascale selfcheck --judge: {path} is no JSON report of --json ({exc})", file=sys.stderr)
            return 2
        results[report["node"]] = {"ok": True, "report": report}
    verdict = judge(results, min_ratio)
    for node in results:
        print(f"{node}: {'FAILED: ' + verdict['failed'][node] if node in verdict['failed'] else 'PASSED'}")
    if verdict["suspects"]:
        print(f"cannot tell which end is bad: {', '.join(verdict['suspects'])}")
    return 1 if verdict["failed"] else 0
