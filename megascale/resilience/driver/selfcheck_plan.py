"""Who checks what with whom: the driver's plan for the self-check.

Each live node runs its local tests and pair tests with its ring neighbours (node i with i+1),
scheduled in rounds so that no node is in two pairs at once (a ring of odd length needs a
third round). Who failed is the verdict over the reports (`selfcheck/verdict.py`).
"""

from __future__ import annotations

from typing import Any

from megascale.config.operations import ResilienceConfig
from megascale.resilience.driver.placement import rendezvous_port
from megascale.resilience.driver.state import Node

PAIR_TIMEOUT_S = 6.0


def ring_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Edges (i, i+1 mod n) of a ring coloured into rounds of disjoint pairs."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    edges = [(i, (i + 1) % n) for i in range(n)]
    rounds = [[e for e in edges[: n - (n % 2)] if e[0] % 2 == 0], [e for e in edges[: n - (n % 2)] if e[0] % 2 == 1]]
    if n % 2:
        rounds.append([edges[-1]])
    return [r for r in rounds if r]


def build(nodes: list[Node], ranks_per_node: int, cfg: ResilienceConfig) -> dict[str, dict[str, Any]]:
    plans = {
        n.node_id: {
            "ranks": ranks_per_node,
            "expected_file": cfg.selfcheck_expected,
            "min_ratio": cfg.selfcheck_min_ratio,
            "pair_timeout_s": PAIR_TIMEOUT_S,
            "pairs": [],
        }
        for n in nodes
    }
    for index, pairs in enumerate(ring_rounds(len(nodes))):
        for a, b in pairs:
            port = rendezvous_port(cfg.rendezvous_port, index, offset=500 + a)
            first, second = nodes[a], nodes[b]
            for role, me, peer in ((0, first, second), (1, second, first)):
                plans[me.node_id]["pairs"].append(
                    {"round": index, "peer": peer.node_id, "role": role, "master": first.address, "port": port}
                )
    for plan in plans.values():
        plan["pairs"].sort(key=lambda p: p["round"])
    return plans
