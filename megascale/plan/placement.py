"""Rank-to-node placement: tp inside a node, each dp group under as few ToRs as possible, then pp.

Ranks follow the job's one rank order (`layout/grid.py`: tp innermost, then dp, then pp), and the launcher gives
node k the ranks k*G .. k*G+G-1 (G GPUs per node). So a tensor-parallel group (tp divides G)
never leaves a node, and the ranks of one pipeline stage (all its dp groups) are a run of
consecutive logical nodes: a *block*. Placement is then choosing which physical host becomes
each logical node. MegaScale (section 3.6) schedules data-intensive nodes under the same ToR:
here each block goes to the ToR with the fewest free hosts that still holds it whole (best
fit), else it is spread over the ToRs with the most free hosts, staying in one pod when it
can; consecutive stages land next to each other, so pipeline sends stay local too.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from megascale.config.fields import ConfigError
from megascale.layout.grid import DIMS, RankGrid
from megascale.plan.cluster import ClusterSpec
from megascale.plan.layout import Layout


@dataclass(frozen=True)
class Host:
    name: str
    tor: int
    pod: int


@dataclass(frozen=True)
class Placement:
    """`hosts[k]` runs logical node k, i.e. global ranks k*G .. k*G+G-1."""

    layout: Layout
    gpus_per_node: int
    hosts: tuple[Host, ...]

    def host_of(self, rank: int) -> Host:
        return self.hosts[rank // self.gpus_per_node]

    def local_gpu(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def rank_order(self) -> list[str]:
        """Host names in launcher order (node rank k = line k), e.g. for a hostfile."""
        return [h.name for h in self.hosts]

    def group_tors(self, group: list[int]) -> int:
        return len({self.host_of(r).tor for r in group})


def synthetic_hosts(cluster: ClusterSpec, nodes: int) -> list[Host]:
    """Hosts named by their position in the Clos: node i under ToR i // nodes_per_tor."""
    net = cluster.network
    hosts = []
    for i in range(nodes):
        tor = i // net.nodes_per_tor
        hosts.append(Host(f"pod{tor // net.tors_per_pod}-tor{tor}-node{i}", tor, tor // net.tors_per_pod))
    return hosts


def read_hosts(path: str | Path) -> list[Host]:
    """A host list, one `name tor [pod]` per line (`#` comments), as the scheduler reports it."""
    hosts = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) not in (2, 3):
            raise ConfigError(f"{path}:{lineno}: expected 'name tor [pod]', got {line!r}")
        try:
            tor = int(fields[1])
            pod = int(fields[2]) if len(fields) == 3 else 0
        except ValueError as exc:
            raise ConfigError(f"{path}:{lineno}: tor and pod must be integers") from exc
        hosts.append(Host(fields[0], tor, pod))
    return hosts


def mesh_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """Global ranks of every tp, dp and pp group (and cp's, where the layout has cp > 1), in the
    job's rank order."""
    grid = RankGrid.of(layout)
    return {dim: grid.groups(dim) for dim in DIMS if dim != "cp" or grid.cp > 1}


def place(layout: Layout, hosts: list[Host], gpus_per_node: int) -> Placement:
    """Topology-aware placement of `layout` on `hosts` (any order, any ToR sizes)."""
    nodes = _check(layout, hosts, gpus_per_node)
    block = max(1, layout.dp * layout.tp // gpus_per_node)  # logical nodes per pipeline stage
    free: dict[int, list[Host]] = defaultdict(list)
    for host in sorted(hosts, key=lambda h: (h.pod, h.tor, h.name)):
        free[host.tor].append(host)
    pod_of = {h.tor: h.pod for h in hosts}
    order: list[Host] = []
    last_pod = None
    while len(order) < nodes:
        need = min(block, nodes - len(order))
        whole = [t for t in free if len(free[t]) >= need]
        if whole:  # best fit, preferring the pod of the previous stage
            tor = min(whole, key=lambda t: (len(free[t]), pod_of[t] != last_pod, t))
            taken = [free[tor].pop(0) for _ in range(need)]
        else:  # spread over the fullest ToRs of the pod with the most room
            pods: dict[int, int] = defaultdict(int)
            for t, hs in free.items():
                pods[pod_of[t]] += len(hs)
            pod = max(pods, key=lambda p: (pods[p] >= need, p == last_pod, pods[p], -p))
            tors = sorted((t for t in free if free[t]), key=lambda t: (pod_of[t] != pod, -len(free[t]), t))
            taken = []
            for tor in tors:
                while free[tor] and len(taken) < need:
                    taken.append(free[tor].pop(0))
        for host in taken:
            if not free[host.tor]:
                free.pop(host.tor, None)
        last_pod = taken[-1].pod
        order.extend(taken)
    return Placement(layout, gpus_per_node, tuple(order))


def scheduler_order(layout: Layout, hosts: list[Host], gpus_per_node: int, seed: int = 0) -> Placement:
    """The baseline: hosts in whatever order the scheduler handed them out (here: shuffled)."""
    nodes = _check(layout, hosts, gpus_per_node)
    shuffled = list(hosts)
    random.Random(seed).shuffle(shuffled)
    return Placement(layout, gpus_per_node, tuple(shuffled[:nodes]))


def _check(layout: Layout, hosts: list[Host], gpus_per_node: int) -> int:
    if layout.tp > gpus_per_node or gpus_per_node % layout.tp:
        raise ConfigError(f"tp={layout.tp} must divide the {gpus_per_node} GPUs of a node")
    if layout.world % gpus_per_node:
        raise ConfigError(f"{layout.world} ranks do not fill whole {gpus_per_node}-GPU nodes")
    nodes = layout.world // gpus_per_node
    if len(hosts) < nodes:
        raise ConfigError(f"layout needs {nodes} nodes, only {len(hosts)} hosts given")
    return nodes


def describe(placement: Placement) -> dict[str, float]:
    """How local each group is: mean/max ToRs spanned per dp group, nodes per tp group."""
    groups = mesh_groups(placement.layout)
    dp_tors = [placement.group_tors(g) for g in groups["dp"]]
    tp_nodes = [len({placement.host_of(r).name for r in g}) for g in groups["tp"]]
    pp_tors = [placement.group_tors(g) for g in groups["pp"]]
    return {
        "dp_group_tors_mean": sum(dp_tors) / len(dp_tors),
        "dp_group_tors_max": max(dp_tors),
        "tp_group_nodes_max": max(tp_nodes),
        "pp_group_tors_mean": sum(pp_tors) / len(pp_tors),
    }
