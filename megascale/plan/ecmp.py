"""Flow-level Monte Carlo of ECMP hash collisions on a three-tier Clos, for a concrete placement.

Data-parallel traffic: every GPU of a dp ring sends one flow to its ring successor, all rings at
once (a ZeRO reduce-scatter/all-gather step); pipeline traffic: every GPU of stage i sends to
its peer in stage i+1. A flow between GPUs of one node uses NVLink; between nodes it leaves
through the GPU's NIC to its ToR (to rail switch k for NIC k when the fabric is multi-rail).
Under one ToR it goes straight down to the peer; else
the ToR hashes it onto one of its uplinks (to aggregation switch u of its pod), and between pods
the aggregation switch hashes it again onto a core uplink; the way down is fixed by the switch
the flow reached (a fat tree's planes). ECMP hashes the 5-tuple, which we model as uniform and
independent per flow. A link shared by more flows than its capacity (in NIC rates) splits
fairly; a ring moves at the speed of its slowest flow, and the collective ends with the slowest
ring. The slowdown is that end time over the time with no collisions.

With 400G ports split into 2x200G downlinks (MegaScale, "network performance tuning") each uplink carries two
full-rate NIC flows, so collisions start at three flows per link instead of two.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from megascale.plan.cluster import ClusterSpec
from megascale.plan.placement import Placement, mesh_groups


@dataclass(frozen=True)
class Fabric:
    uplinks: int  # ToR -> aggregation links per ToR (= aggregation -> core per agg switch)
    capacity: float  # capacity of one uplink/downlink in NIC line rates
    rails: int = 1  # ToR switches per rail group; NIC k of a node goes to switch k

    @classmethod
    def of(cls, cluster: ClusterSpec, split: bool | None = None) -> Fabric:
        """Same total uplink bandwidth either way: U links of 2 NIC rates, or 2U of one."""
        net = cluster.network
        split = net.split_downlinks if split is None else split
        if split:
            return cls(uplinks=net.uplinks_per_tor, capacity=2.0, rails=net.rails)
        return cls(uplinks=2 * net.uplinks_per_tor, capacity=1.0, rails=net.rails)


@dataclass(frozen=True)
class EcmpResult:
    slowdown: float  # mean over trials of (collective time / collision-free time)
    worst_slowdown: float
    collided_flows: float  # mean fraction of network flows slowed by a collision
    cross_tor_flows: int  # flows that leave their ToR (the ones ECMP can hash badly)
    network_flows: int


def dp_flows(placement: Placement) -> list[tuple[int, int]]:
    """(source rank, destination rank) of every ring step of every dp group."""
    flows: list[tuple[int, int]] = []
    for group in mesh_groups(placement.layout)["dp"]:
        if len(group) > 1:
            flows.extend((group[i], group[(i + 1) % len(group)]) for i in range(len(group)))
    return flows


def pp_flows(placement: Placement) -> list[tuple[int, int]]:
    """(source rank, destination rank) of the forward sends of every pipeline boundary."""
    return [(g[i], g[i + 1]) for g in mesh_groups(placement.layout)["pp"] for i in range(len(g) - 1)]


def simulate(placement: Placement, fabric: Fabric, trials: int = 20, seed: int = 0, kind: str = "dp") -> EcmpResult:
    flows = []
    gpn = placement.gpus_per_node
    for src, dst in dp_flows(placement) if kind == "dp" else pp_flows(placement):
        a, b = placement.host_of(src), placement.host_of(dst)
        if a.name != b.name:
            rail = placement.local_gpu(src) * fabric.rails // gpn
            flows.append((src, dst, (a.tor, rail), (b.tor, rail), a, b))
    cross = [f for f in flows if f[4].tor != f[5].tor]
    if not cross:
        return EcmpResult(1.0, 1.0, 0.0, 0, len(flows))
    rng = random.Random(seed)
    slowdowns, collided = [], []
    for _ in range(trials):
        paths = []
        load: Counter = Counter()
        for _src, _dst, switch_a, switch_b, a, b in cross:
            up = rng.randrange(fabric.uplinks)
            links: list[tuple[Any, ...]] = [("tor_up", switch_a, up)]
            if a.pod == b.pod:
                links.append(("tor_down", switch_b, up))
            else:
                core = rng.randrange(fabric.uplinks)
                links += [
                    ("agg_up", a.pod, switch_a[1], up, core),
                    ("agg_down", b.pod, switch_b[1], up, core),
                    ("tor_down", switch_b, up),
                ]
            paths.append(links)
            load.update(links)
        rates = [min(1.0, min(fabric.capacity / load[link] for link in links)) for links in paths]
        slowdowns.append(1.0 / min(rates))
        collided.append(sum(r < 1.0 for r in rates) / len(flows))
    return EcmpResult(
        slowdown=sum(slowdowns) / trials,
        worst_slowdown=max(slowdowns),
        collided_flows=sum(collided) / trials,
        cross_tor_flows=len(cross),
        network_flows=len(flows),
    )
