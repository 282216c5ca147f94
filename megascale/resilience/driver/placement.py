"""Where an attempt's ranks go: the layout for the nodes at hand, ranks per slot, the rendezvous.

With fewer nodes than wanted (evictions and no spares) the job shrinks its data-parallel
degree: tp and pp stay (the model's split is fixed by memory), dp becomes what the ranks allow,
provided the global batch still divides into micro-batches; the checkpoint is resharded on load.
"""

from __future__ import annotations

from megascale.config.schema import JobConfig
from megascale.parallel.store import free_port


class PlacementError(RuntimeError):
    """No layout fits the nodes that are left."""


def layout_for(cfg: JobConfig, nodes: int, ranks_per_node: int) -> dict[str, int]:
    p, t = cfg.parallel, cfg.train
    world = nodes * ranks_per_node
    model_ranks = p.tp * p.pp
    if world % model_ranks:
        raise PlacementError(
            f"{nodes} node(s) x {ranks_per_node} ranks = {world} ranks is not a multiple of tp*pp = {model_ranks}"
        )
    dp = world // model_ranks
    if t.global_batch % (t.micro_batch * dp):
        raise PlacementError(
            f"dp={dp} on {nodes} node(s): train.global_batch={t.global_batch} is not "
            f"a multiple of micro_batch*dp = {t.micro_batch * dp}"
        )
    return {"dp": dp, "tp": p.tp, "pp": p.pp}


def usable_nodes(cfg: JobConfig, available: int, wanted: int, ranks_per_node: int) -> int:
    """The most nodes (at most `wanted`) on which some dp fits; 0 if none."""
    for n in range(min(available, wanted), 0, -1):
        try:
            layout_for(cfg, n, ranks_per_node)
            return n
        except PlacementError:
            continue
    return 0


def slot_ranks(slot: int, ranks_per_node: int) -> list[int]:
    return list(range(slot * ranks_per_node, (slot + 1) * ranks_per_node))


def rendezvous_port(base: int, attempt: int, offset: int = 0) -> int:
    """`base + offset + attempt` when a base is configured (clusters: open that range), else a
    port free on this host now (local mode: every simulated node is reachable from here)."""
    if base:
        return base + offset + attempt % 1000
    return free_port("")
