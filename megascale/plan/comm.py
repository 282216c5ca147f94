"""Time of the collectives a step issues, over the links each communication group crosses.

Ranks follow the launcher's order `rank = (pp_i * dp + dp_i) * tp + tp_i` with nodes filled in
topology order (see `placement.py`), so a group is described by its size and the rank stride
between its members: tp groups have stride 1, dp groups stride tp, pp groups stride tp*dp.
From that follow how many members share a node (they talk over NVLink), how many nodes, ToRs and
pods the group spans, and so the slowest link a ring over it must cross.

Ring all-gather / reduce-scatter of a buffer of S bytes (the full, gathered size) over n ranks
moves (n-1)/n * S bytes through every rank's slowest link and pays n-1 step latencies;
all-reduce is the better of a ring (twice that) and a double binary tree (same bandwidth term,
2*log2(n) latencies), as NCCL chooses. Formulas and figures: docs/planning.md ("Communication").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megascale.plan.cluster import ClusterSpec


@dataclass(frozen=True)
class Link:
    """The bottleneck a ring over a group sees: bus bandwidth per rank and per-step latency."""

    bytes_per_s: float
    latency_s: float
    scope: str  # "self", "node", "tor", "pod" or "cluster": the widest level the group spans

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0:
            raise ValueError("link bandwidth must be > 0")


@dataclass(frozen=True)
class GroupSpan:
    size: int
    per_node: int  # members sharing one node
    per_tor: int  # members sharing one ToR
    per_pod: int  # members sharing one pod
    nodes: int
    tors: int
    pods: int


def group_span(cluster: ClusterSpec, size: int, stride: int) -> GroupSpan:
    """Where a group of `size` ranks `stride` apart lands when nodes are filled in order."""
    net = cluster.network
    gpus_per_tor = cluster.gpus_per_node * net.nodes_per_tor
    gpus_per_pod = gpus_per_tor * net.tors_per_pod

    def per(gpus: int) -> int:
        return max(1, min(size, gpus // stride))

    per_node, per_tor, per_pod = per(cluster.gpus_per_node), per(gpus_per_tor), per(gpus_per_pod)
    return GroupSpan(
        size=size,
        per_node=per_node,
        per_tor=per_tor,
        per_pod=per_pod,
        nodes=-(-size // per_node),
        tors=-(-size // per_tor),
        pods=-(-size // per_pod),
    )


def group_link(cluster: ClusterSpec, size: int, stride: int, network_slowdown: float = 1.0) -> Link:
    """Bus bandwidth of a ring over the group, limited by NVLink, NICs and oversubscribed uplinks.

    A ring crosses each node boundary once, so its k members on a node share k NICs. Crossing a
    ToR it leaves through one uplink per ring; the ToR's uplink capacity, split among the
    groups under it, limits the ring only when few members share a ToR and uplinks are
    oversubscribed. `network_slowdown` (>= 1) folds in ECMP collisions from `ecmp.py`.
    """
    span = group_span(cluster, size, stride)
    node, net = cluster.node, cluster.network
    if size == 1:
        return Link(node.nvlink_bytes_per_s, 0.0, "self")
    if span.nodes == 1:
        return Link(node.nvlink_bytes_per_s, node.nvlink_latency_s, "node")
    per_gpu = node.network_bytes_per_gpu * net.efficiency
    bandwidth = min(node.nvlink_bytes_per_s, span.per_node * per_gpu)
    scope = "tor"
    if span.tors > 1:
        scope = "pod"
        bandwidth = min(bandwidth, span.per_tor * per_gpu / net.oversubscription[0])
        bandwidth /= network_slowdown
    if span.pods > 1:
        scope = "cluster"
        over = net.oversubscription[0] * net.oversubscription[1]
        bandwidth = min(bandwidth, span.per_pod * per_gpu / over)
    return Link(bandwidth, net.hop_latency_s, scope)


def p2p_link(cluster: ClusterSpec, stride: int, network_slowdown: float = 1.0) -> Link:
    """Link between a rank and the rank `stride` away (pipeline neighbours); `network_slowdown`
    folds in ECMP collisions of the hops that leave a ToR (congestion.pp_traffic)."""
    if stride < cluster.gpus_per_node:
        return Link(cluster.node.nvlink_bytes_per_s, cluster.node.nvlink_latency_s, "node")
    per_gpu = cluster.node.network_bytes_per_gpu * cluster.network.efficiency
    return Link(per_gpu / network_slowdown, cluster.network.hop_latency_s, "tor")


def all_gather_time(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather producing `nbytes` on every rank (each contributes nbytes/n)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s


def reduce_scatter_time(n: int, nbytes: float, link: Link) -> float:
    """Ring reduce-scatter of an `nbytes` input: same traffic as the all-gather, mirrored."""
    return all_gather_time(n, nbytes, link)


def all_reduce_time(n: int, nbytes: float, link: Link) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    ring = 2 * (n - 1) / n * nbytes / link.bytes_per_s + 2 * (n - 1) * link.latency_s
    tree = 2 * nbytes / link.bytes_per_s + 2 * math.ceil(math.log2(n)) * link.latency_s
    return min(ring, tree)


def all_to_all_time(n: int, nbytes: float, link: Link) -> float:
    """All-to-all where every rank holds `nbytes` for the n ranks (itself included): (n-1)/n of
    it leaves through the rank's slowest link, in n-1 pairwise steps."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s


def p2p_time(nbytes: float, link: Link) -> float:
    return nbytes / link.bytes_per_s + link.latency_s


def chunked_overlap_exposed(comm: float, gemm_full: float, gemm_chunk: float, chunks: int) -> float:
    """Exposed time when a collective is split into `chunks` pipelined against a GEMM's chunks.

    The pipeline runs the first chunk's communication alone, then `chunks-1` steps bound by the
    slower of communication and GEMM, then the last GEMM chunk. What exceeds the unsplit GEMM is
    exposed. Never more than running them one after the other (a runtime falls back to that).
    """
    if comm <= 0:
        return 0.0
    c = comm / chunks
    pipelined = c + (chunks - 1) * max(c, gemm_chunk) + gemm_chunk
    return min(comm, max(0.0, pipelined - gemm_full))
