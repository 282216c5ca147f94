"""The real driver against simulated executors at 8 to 1,536 nodes: does its work per node stay flat?

For each size N: a real `megascale launch --external` driver (N nodes of 8 ranks, the configured
1 s heartbeat and 5 s timeout), and N simulated executors in this process
(`megascale/testing/simnodes.py`: real TLS, token, HTTP/1.1, schemas, payload shape). Measured:
registration of all N at once (wall, and the driver's CPU per registration), a steady window of
heartbeats (the driver's CPU per heartbeat and its share of a core, round-trip p50/p99, RSS, a
status call), then one node falls silent: the time until the driver acts on it (the first
recovery command another node receives), and every fault it raised (false faults: any but that one).

The machine is shared (2 cores, other work running, and the simulated nodes themselves share
those cores with the driver): CPU time per operation, read from /proc, is the reliable figure;
latencies are upper bounds. `python bench/scale.py [--sizes 8,128,512,1536] [--window-s 10]`
writes bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from megascale.resilience.driver.api_server import raise_fd_limit
from megascale.testing.scale import RANKS_PER_NODE, REPO, run_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8,128,512", help="node counts (the issue's curve: 8,128,512,1536)")
    parser.add_argument("--window-s", type=float, default=10.0, help="steady heartbeat window per size")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=5.0,
        help="the driver's heartbeat timeout (the default 5 s); raise it only where the simulated "
        "nodes cannot beat in time on a loaded machine (it is recorded)",
    )
    parser.add_argument(
        "--driver-repo", default=str(REPO), help="run the driver from this source tree (an older commit's, to compare)"
    )
    args = parser.parse_args(argv)
    raise_fd_limit()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        row = run_size(n, args.window_s, [], Path(args.driver_repo), args.heartbeat_timeout_s)
        row["loadavg"] = os.getloadavg()
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["driver_cpu_per_heartbeat_ms"]
    for row in rows:
        row["cpu_per_heartbeat_vs_smallest"] = row["driver_cpu_per_heartbeat_ms"] / base
    big = rows[-1]
    goals = {
        "nodes": big["nodes"],
        "registered_within_60_s": big["register_s"] < 60,
        "driver_below_half_a_core_at_1_hz": big["driver_cores_at_1_hz"] < 0.5,
        "rtt_p99_below_quarter_of_timeout": big["rtt_p99_ms"] < 1e3 * args.heartbeat_timeout_s / 4,
        "cpu_per_heartbeat_within_2x_of_smallest": big["cpu_per_heartbeat_vs_smallest"] <= 2.0,
        "no_false_faults": all(r["false_faults"] == 0 for r in rows),
    }
    result = {
        "bench": "scale",
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "note": "shared machine, other work running; the simulated nodes run on the same cores as the driver",
        },
        "heartbeat_s": 1.0,
        "heartbeat_timeout_s": args.heartbeat_timeout_s,
        "ranks_per_node": RANKS_PER_NODE,
        "window_s": args.window_s,
        "sizes": rows,
        "goals": goals,
        "median_cpu_per_heartbeat_ms": statistics.median(r["driver_cpu_per_heartbeat_ms"] for r in rows),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
