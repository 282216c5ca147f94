"""Who failed the self-check: the verdict over the reports of the nodes checked together.

A node fails when a local test fails, when it gives no result, when every pair it was in failed
while one of its peers passed with someone else (a bad link shows up in both ends' results, and
the healthy end is the one that works with another neighbour), or when a figure falls below
`selfcheck_min_ratio` of the other nodes' median (`relative`): a node at half its peers' speed
passes any absolute floor but not this. The driver judges its fleet's reports with it, and
`megascale selfcheck --judge` the reports an operator collected: one verdict for both.
"""

from __future__ import annotations

import statistics
from typing import Any

# Judged against floors only, neither against the other nodes nor against a baseline: two threads
# of one process through the kernel's TCP stack. Its best of 5 varied 2x between healthy nodes
# checked together on a shared host, and a healthy node's worst check was 0.35-0.78 of its
# best (five series of 10-12), so a 0.7 ratio failed healthy nodes checked alone. The link's real
# path is judged by the pair tests and the all-to-all among the node's ranks, against the fleet.
FLOOR_ONLY = ("loopback_bandwidth",)


def judge(results: dict[str, dict[str, Any] | None], min_ratio: float) -> dict[str, Any]:
    failed: dict[str, str] = {}
    pair_ok: dict[str, list[bool]] = {}
    slow = relative(results, min_ratio)
    for node, result in results.items():
        if not result or not result.get("ok") or not result.get("report"):
            failed[node] = f"self-check did not complete: {(result or {}).get('error') or 'no result'}"
            continue
        for test in result["report"]["tests"]:
            if test.get("peer") is not None:
                pair_ok.setdefault(node, []).append(test["passed"])
            elif not test["passed"]:
                failed[node] = f"{test['name']}: {test.get('error') or _figure(test)}"
    for node, why in slow.items():
        failed.setdefault(node, why)
    healthy_pairs = {n for n, oks in pair_ok.items() if any(oks)}
    suspects = []
    for node, oks in pair_ok.items():
        if node in failed or any(oks):
            continue
        peers = [t["peer"] for t in results[node]["report"]["tests"] if t.get("peer") is not None]
        if any(p in healthy_pairs for p in peers):
            failed[node] = f"every link test failed ({', '.join(peers)}) while its peers pass with others"
        else:
            suspects.append(node)
    return {"failed": failed, "suspects": suspects}


def relative(results: dict[str, dict[str, Any] | None], min_ratio: float) -> dict[str, str]:
    """Nodes with a figure below `min_ratio` of the median of the nodes of the same hardware
    checked together: all of them (itself included, so one lucky node cannot raise the bar) when
    there are three or more, the other one when there are two. A node's link figure is its best
    link's p2p bandwidth: a slowed link slows every pair its node is in, while each of its peers
    still has a fast one."""
    figures: dict[str, dict[str, dict[str, float]]] = {}  # hardware -> node -> test -> value
    for node, result in results.items():
        report = (result or {}).get("report") if (result or {}).get("ok") else None
        if not report:
            continue
        mine = figures.setdefault(report.get("hardware", ""), {}).setdefault(node, {})
        for test in report["tests"]:
            if "error" in test:
                continue
            if test.get("peer") is None and test["name"] not in FLOOR_ONLY:
                mine[test["name"]] = test["value"]
            elif test["name"] == "p2p_bandwidth":
                mine["best link"] = max(mine.get("best link", 0.0), test["value"])
    slow: dict[str, str] = {}
    for nodes in figures.values():
        for node, mine in nodes.items():
            for name, value in mine.items():
                fleet = [f[name] for n, f in nodes.items() if name in f and (n != node or len(nodes) > 2)]
                if len(fleet) < (2 if len(nodes) > 2 else 1):
                    continue
                median = statistics.median(fleet)
                if value < min_ratio * median and node not in slow:
                    slow[node] = (
                        f"{name}: {value:.3g} is {value / median:.0%} of the median {median:.3g} of "
                        f"the {len(nodes)} nodes checked together (min {min_ratio:.0%})"
                    )
    return slow


def _figure(test: dict[str, Any]) -> str:
    return f"{test['value']:.3g} {test['unit']} < expected {test['expected']:.3g} {test['unit']}"
