"""Where an attempt's ranks go: the layout for the nodes at hand, ranks per slot, the rendezvous.

With fewer nodes than wanted (evictions and no spares) the job shrinks its data-parallel
degree: tp, pp and cp stay (the model's split is fixed by memory), dp becomes what the ranks
allow, and the checkpoint is resharded on load. `resilience.shrink` says how: "keep-batch" (the
default) takes the largest dp the ranks hold and splits the same global batch unevenly over the
replicas (`config/shares.py`: some take one micro-batch more), so every step trains on the same
sequences with the same gradient as before; "divide" takes the largest dp that divides the
batch into equal shares (dp 192 -> 128 after losing 1 of 1,536 nodes: a third of them idle).
`shrink_cost` is the log line that says what the layout costs against the job's full one.
"""

from __future__ import annotations

from dataclasses import replace

from megascale.config.fields import ConfigError
from megascale.config.schema import JobConfig
from megascale.layout.grid import RankGrid
from megascale.parallel.store import free_port


class PlacementError(RuntimeError):
    """No layout fits the nodes that are left."""


def layout_for(cfg: JobConfig, nodes: int, ranks_per_node: int) -> dict[str, int]:
    """The layout on `nodes` whole nodes; PlacementError when the ranks do not make whole model
    replicas or the config rejects their dp (the batch under `resilience.shrink`, ep, vpp)."""
    p = cfg.parallel
    world = nodes * ranks_per_node
    model_ranks = p.tp * p.pp * p.cp
    if world % model_ranks:
        raise PlacementError(
            f"{nodes} node(s) x {ranks_per_node} ranks = {world} ranks is not a multiple of tp*pp*cp = {model_ranks}"
        )
    dp = world // model_ranks
    try:
        replace(cfg, parallel=replace(p, dp=dp)).validate()
    except ConfigError as exc:
        raise PlacementError(f"dp={dp} on {nodes} node(s): {exc}") from None
    return {"dp": dp, "tp": p.tp, "pp": p.pp, "cp": p.cp}


def usable_nodes(cfg: JobConfig, available: int, wanted: int, ranks_per_node: int) -> int:
    """The most nodes (at most `wanted`) on which some dp fits; 0 if none."""
    for n in range(min(available, wanted), 0, -1):
        try:
            layout_for(cfg, n, ranks_per_node)
            return n
        except PlacementError:
            continue
    return 0


def step_slots(cfg: JobConfig, dp: int) -> float:
    """A step's length in micro-batch times of one stage: the busiest replica's micro-batches
    plus the pipeline's fill and drain, (pp - 1) / vpp (1F1B; per-micro-batch work and the
    gradient reduction's time do not depend on dp at fixed tp, pp and micro-batch size)."""
    p = cfg.parallel
    most = replace(cfg, parallel=replace(p, dp=dp)).micro_batches
    return most + (p.pp - 1) / p.vpp


def shrink_cost(cfg: JobConfig, wanted: int, available: int, used: int, ranks_per_node: int) -> str:
    """What running on `used` of `available` nodes costs against the job's `wanted`: idle nodes,
    the split of the batch, the expected tokens/s against the full layout (`step_slots`), and
    what the other `resilience.shrink` would have done."""
    full, now = layout_for(cfg, wanted, ranks_per_node)["dp"], layout_for(cfg, used, ranks_per_node)["dp"]
    shares = replace(cfg, parallel=replace(cfg.parallel, dp=now)).shares
    ratio = step_slots(cfg, full) / step_slots(cfg, now)
    mode = cfg.resilience.shrink
    other = "divide" if mode == "keep-batch" else "keep-batch"
    alt_cfg = replace(cfg, resilience=replace(cfg.resilience, shrink=other))
    alt_nodes = usable_nodes(alt_cfg, available, wanted, ranks_per_node)
    if alt_nodes:
        alt_dp = layout_for(alt_cfg, alt_nodes, ranks_per_node)["dp"]
        alt = (
            f"{other} would use {alt_nodes} nodes (dp {alt_dp}, "
            f"{step_slots(cfg, full) / step_slots(alt_cfg, alt_dp):.3f}x)"
        )
    else:
        alt = f"{other} fits no layout"
    return (
        f"shrink ({mode}): {used} of {available} node(s) train, {available - used} idle "
        f"({_why_idle(cfg, available * ranks_per_node, now)}); dp {full} -> {now}, "
        f"global batch {cfg.train.global_batch} kept as {shares.describe()}; expected tokens/s "
        f"{ratio:.3f}x the {wanted}-node layout's (a step of {step_slots(cfg, now):g} micro-batch times "
        f"against {step_slots(cfg, full):g}); {alt}"
    )


def compute_scale(cfg: JobConfig, layout: dict[str, int]) -> dict[int, float]:
    """Per rank, the busiest replica's micro-batches over its own replica's: the fail-slow rule
    judges compute times at this factor, so that under uneven shares a replica running one
    micro-batch fewer does not make its peers look slow (the optimizer's share of a step is
    scaled too: a few percent at 8 and 9). {} when the shares are even."""
    p = replace(cfg.parallel, dp=layout["dp"])
    shares = replace(cfg, parallel=p).shares
    if shares.even:
        return {}
    grid = RankGrid.of(p)
    return {r: shares.most / shares.micro_batches(grid.coords(r).dp) for r in range(grid.world_size)}


def _why_idle(cfg: JobConfig, ranks: int, dp: int) -> str:
    replica = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    left = ranks - dp * replica
    if left < replica:
        return f"{left} ranks left over; a replica is tp*pp*cp = {replica}"
    return f"dp {dp + 1} to {ranks // replica} would not split the batch under resilience.shrink"


def slot_ranks(slot: int, ranks_per_node: int) -> list[int]:
    return list(range(slot * ranks_per_node, (slot + 1) * ranks_per_node))


def rendezvous_port(base: int, attempt: int, offset: int = 0) -> int:
    """`base + offset + attempt` when a base is configured (clusters: open that range), else a
    port free on this host now (local mode: every simulated node is reachable from here)."""
    if base:
        return base + offset + attempt % 1000
    return free_port("")
