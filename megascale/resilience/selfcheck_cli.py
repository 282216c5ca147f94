"""`megascale selfcheck`: run the node and network self-checks by hand or for the executor.

By hand on one node: `megascale selfcheck --ranks 4`. With a neighbour: start
`megascale selfcheck --peer B --role 0 --master A_ADDR --port P` on A and `--role 1` on B.
`--measure FILE` writes the figures measured here, halved, as the expected floors for
`resilience.selfcheck_expected`. The executor passes the driver's plan as JSON (`--plan`).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from megascale.resilience.selfcheck import run_checks


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
    parser.add_argument("--measure", help="write measured figures x 0.5 as expected floors to FILE")


def run(args: argparse.Namespace) -> int:
    if args.plan:
        plan = json.loads(args.plan)
    else:
        pairs = ([{"peer": args.peer, "role": args.role, "master": args.master, "port": args.port}]
                 if args.peer else [])
        plan = {"ranks": args.ranks, "expected_file": args.expected, "pairs": pairs}
    report = run_checks(args.node_id, plan)
    if args.measure:
        floors = {t["name"]: round(t["value"] * 0.5, 3) for t in report["tests"] if "error" not in t}
        Path(args.measure).write_text(json.dumps(floors, indent=2) + "\n")
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
