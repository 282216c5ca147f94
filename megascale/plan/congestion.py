"""ECMP hash collisions in closed form: how much slower every flow that leaves a ToR goes.

A ToR (rail) switch hashes each flow that leaves it onto one of its `U` uplinks, uniformly and
independently (the 5-tuple hash); the aggregation switch it reached sends it down to the peer's
ToR on the matching downlink, which is again a uniform draw. A link that carries more flows than
its capacity `c` (in flows at full NIC rate) shares fairly, and a collective or a pipeline hop
finishes with its slowest flow. So the slowdown of a traffic class is `E[max(1, K / c)]`, where
`K` is the fullest link among all the links its flows use.

For `F` flows hashed onto `U` links the load vector is multinomial; the probability that no link
carries more than `k` flows is exact by Poissonization: with `Y_i ~ Poisson(F/U)` independent,
`P(max <= k) = P(sum Y_i = F, all Y_i <= k) / P(sum Y_i = F)`, a U-fold convolution of the
truncated Poisson pmf. Switches hash independently, so over `S` such switches the probability is
that to the power `S`. NCCL opens `q` connections per ring hop (channels x QPs) that hash apart,
each at `1/q` of the NIC rate: the flow count is `q` times the hops and the capacity `q` times.

Which flows leave a ToR follows from the layout and the planner's placement (nodes filled in
launcher order, `placement.place`): a data-parallel ring leaves each rail group it spans once;
a pipeline boundary sends from every node whose next-stage peer sits in another rail group;
tensor parallelism never leaves a node. `ecmp.simulate` draws the same hashes flow by flow and
checks this model (tests/plan/test_effects.py). Formulas: docs/planning.md ("Congestion").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from megascale.plan.cluster import ClusterSpec


@dataclass(frozen=True)
class Traffic:
    """Flows one traffic class sends out of each busy switch at once, and how many switches."""

    flows_per_switch: int  # connections (hops x flows_per_connection) leaving one ToR switch
    switches: int  # switches whose uplinks (and the matching downlinks) carry such flows
    uplinks: int
    capacity: int  # flows one uplink carries at full rate

    @property
    def slowdown(self) -> float:
        if self.flows_per_switch == 0 or self.switches == 0:
            return 1.0
        return collision_slowdown(
            self.flows_per_switch, self.uplinks, self.capacity, 2 * self.switches
        )  # uplinks out, downlinks in


def _poisson_pmf(lam: float, kmax: int) -> np.ndarray:
    k = np.arange(kmax + 1)
    return np.exp(k * math.log(lam) - lam - np.array([math.lgamma(i + 1) for i in k]))


def _convolve_power(pmf: np.ndarray, times: int, length: int) -> np.ndarray:
    """pmf convolved with itself `times` times, truncated to `length` entries."""
    result = np.zeros(length)
    result[0] = 1.0
    base = pmf[:length]
    while times:
        if times & 1:
            result = np.convolve(result, base)[:length]
        times >>= 1
        if times:
            base = np.convolve(base, base)[:length]
    return result


@lru_cache(maxsize=4096)
def max_load_cdf(flows: int, links: int, k: int) -> float:
    """P(no link holds more than k flows) when `flows` are hashed uniformly onto `links` links."""
    if k >= flows:
        return 1.0
    if k * links < flows:
        return 0.0
    lam = flows / links
    truncated = _poisson_pmf(lam, k)
    inside = _convolve_power(truncated, links, flows + 1)[flows]
    total = math.exp(flows * math.log(flows) - flows - math.lgamma(flows + 1))
    return min(1.0, inside / total)


@lru_cache(maxsize=4096)
def collision_slowdown(flows: int, links: int, capacity: int, switches: int = 1) -> float:
    """E[max(1, K / capacity)], K the fullest link over `switches` switches that each hash
    `flows` flows onto `links` links. 1.0 when nothing can collide."""
    if flows <= capacity:
        return 1.0
    expected, below = 0.0, 0.0
    for k in range(flows + 1):
        cdf = max_load_cdf(flows, links, k) ** switches
        expected += (cdf - below) * max(1.0, k / capacity)
        below = cdf
        if cdf >= 1.0 - 1e-12:
            break
    return expected + (1.0 - below) * flows / capacity


def _uplinks(cluster: ClusterSpec) -> tuple[int, int]:
    """(uplinks per switch, capacity of one in flows): 2x200G split ports carry two NIC flows."""
    net = cluster.network
    q = net.flows_per_connection
    if net.split_downlinks:
        return net.uplinks_per_tor, 2 * q
    return 2 * net.uplinks_per_tor, q


def rail_groups(cluster: ClusterSpec, nodes: int) -> int:
    return -(-nodes // cluster.network.nodes_per_tor)


def dp_traffic(cluster: ClusterSpec, dp: int, tp: int, pp: int) -> Traffic:
    """Data-parallel rings: each of a stage's tp rings leaves every rail group it spans once."""
    gpn, net = cluster.gpus_per_node, cluster.network
    uplinks, capacity = _uplinks(cluster)
    stage_nodes = max(1, dp * tp // gpn)
    groups = rail_groups(cluster, stage_nodes)
    if dp == 1 or groups == 1:
        return Traffic(0, 0, uplinks, capacity)
    rings_per_switch = -(-tp // net.rails)  # ring t leaves through its GPU's rail
    switches = pp * groups * min(tp, net.rails)
    return Traffic(rings_per_switch * net.flows_per_connection, switches, uplinks, capacity)


def pp_traffic(cluster: ClusterSpec, dp: int, tp: int, pp: int) -> Traffic:
    """Pipeline boundaries: every node whose next-stage peer is in another rail group sends out."""
    gpn, net = cluster.gpus_per_node, cluster.network
    uplinks, capacity = _uplinks(cluster)
    stage_nodes = dp * tp / gpn
    total_groups = rail_groups(cluster, max(1, dp * tp * pp // gpn))
    if pp == 1 or stage_nodes < 1 or total_groups == 1:
        return Traffic(0, 0, uplinks, capacity)
    crossing_nodes = min(int(stage_nodes), net.nodes_per_tor)  # per rail group
    per_node = gpn // net.rails  # GPUs of a node behind one rail switch
    flows = crossing_nodes * per_node * net.flows_per_connection
    busy_groups = total_groups if stage_nodes >= net.nodes_per_tor else total_groups - 1
    return Traffic(flows, max(1, busy_groups) * net.rails, uplinks, capacity)
