"""Enumerate the layouts a job could run with on N GPUs, predict each, rank them, and ablate.

A layout is kept if the trainer would accept it (`Layout.check`) and it fits in memory; among
recomputation choices only the cheapest that fits is kept, since recomputing more only adds
work. Ranking is by predicted step time (equivalently tokens/s and MFU at a fixed batch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from megascale.config.fields import ConfigError
from megascale.plan.cluster import ClusterSpec
from megascale.plan.cost import StepEstimate, estimate
from megascale.plan.layout import Features, Layout, Recompute, Schedule, Workload
from megascale.plan.moe import ep_choices
from megascale.plan.system import SystemSpec, ablation_steps, switch_on

RECOMPUTE_ORDER: tuple[Recompute, ...] = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)
MAX_VIRTUAL = 12
LONG_SEQUENCE = 16384  # from here on the search also tries context parallelism


@dataclass(frozen=True)
class SearchSpace:
    zero_stages: tuple[int, ...] = (2,)  # MegaScale runs ZeRO-2
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    max_virtual: int = MAX_VIRTUAL
    max_tp: int | None = None  # default: GPUs per node (tensor parallelism stays on NVLink)
    tps: tuple[int, ...] | None = None  # only these degrees (None: every valid one)
    pps: tuple[int, ...] | None = None
    virtuals: tuple[int, ...] | None = None
    eps: tuple[int, ...] | None = None  # expert-parallel degrees (MoE models; None: every valid one)
    recompute: tuple[Recompute, ...] = RECOMPUTE_ORDER  # tried in this order; the first that fits wins
    cps: tuple[int, ...] | None = None  # None: cp = 1, and for long sequences powers of two in a node
    # pipeline schedules tried when pp > 1: 1f1b (interleaved with v > 1), zb-h1 (v = 1, m >= p),
    # zbv (v = 2, m >= 2p - 1: below that their bubble is larger than the model's formula)
    schedules: tuple[Schedule, ...] = ("1f1b", "zb-h1", "zbv")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(values: list[int], only: tuple[int, ...] | None) -> list[int]:
    return values if only is None else [x for x in values if x in only]


def _schedules(pp: int, micro: int, virtuals: list[int], space: SearchSpace) -> list[tuple[int, Schedule]]:
    """(v, schedule) pairs to try: 1F1B at each v; ZB-H1 at v = 1 with m >= p; ZB-V at v = 2
    with m >= 2p - 1 (with fewer micro-batches their bubble exceeds the cost model's)."""
    if pp == 1:
        return [(v, "1f1b") for v in virtuals]
    runs: list[tuple[int, Schedule]] = [(v, "1f1b") for v in virtuals if "1f1b" in space.schedules]
    if "zb-h1" in space.schedules and micro >= pp:
        runs.append((1, "zb-h1"))
    if "zbv" in space.schedules and micro >= 2 * pp - 1 and 2 in virtuals:
        runs.append((2, "zbv"))
    return runs


def _context_degrees(work: Workload, tp: int, cluster: ClusterSpec, space: SearchSpace) -> list[int]:
    """cp degrees to try: cp's traffic is every layer's, so by default it stays in the node with tp,
    and it is only worth trying when one sequence's activations are large."""
    if space.cps is not None:
        return list(space.cps)
    if work.model.seq_len < LONG_SEQUENCE:
        return [1]
    return [1 << i for i in range((cluster.gpus_per_node // tp).bit_length()) if (1 << i) * tp <= cluster.gpus_per_node]


def candidate_layouts(
    work: Workload, gpus: int, cluster: ClusterSpec, space: SearchSpace | None = None
) -> list[Layout]:
    """Every layout of `gpus` ranks the trainer accepts (before the memory check)."""
    space = space or SearchSpace()
    m = work.model
    max_tp = min(space.max_tp or cluster.gpus_per_node, gpus)
    out: list[Layout] = []
    for tp in _allowed(_divisors(max_tp), space.tps):
        if cluster.gpus_per_node % tp:
            continue
        cps = _context_degrees(work, tp, cluster, space)
        for pp, cp in ((pp, cp) for pp in _allowed(_divisors(m.layers), space.pps) for cp in cps):
            if gpus % (tp * pp * cp):
                continue
            dp = gpus // (tp * pp * cp)
            for mb in space.micro_batches:
                if work.global_batch % (dp * mb):
                    continue
                virtuals = [1] if pp == 1 else [v for v in _divisors(m.layers // pp) if v <= space.max_virtual]
                micro = work.global_batch // (dp * mb)
                for v, schedule in _schedules(pp, micro, _allowed(virtuals, space.virtuals), space):
                    for zero, ep in product(space.zero_stages, ep_choices(work, dp, space.eps)):
                        layout = Layout(
                            dp=dp,
                            tp=tp,
                            pp=pp,
                            v=v,
                            micro_batch=mb,
                            zero=zero if dp > 1 else 0,
                            cp=cp,
                            ep=ep,
                            schedule=schedule,
                        )
                        try:
                            layout.check(work, cluster.gpus_per_node if gpus > 1 else None)
                        except ConfigError:
                            continue
                        out.append(layout)
    return sorted(set(out), key=Layout.label)


def cheapest_fitting(
    work: Workload,
    layout: Layout,
    cluster: ClusterSpec,
    features: Features,
    order: tuple[Recompute, ...] = RECOMPUTE_ORDER,
) -> StepEstimate | None:
    """The layout with the least recomputation that fits in memory, or None."""
    for recompute in order:
        est = estimate(work, replace(layout, recompute=recompute), cluster, features)
        if est.fits:
            return est
    return None


def search(
    work: Workload, gpus: int, cluster: ClusterSpec, features: Features | None = None, space: SearchSpace | None = None
) -> list[StepEstimate]:
    """Fitting layouts, fastest first. Empty when nothing fits (more GPUs or a smaller model)."""
    features = features or Features()
    space = space or SearchSpace()
    results = []
    for layout in candidate_layouts(work, gpus, cluster, space):
        est = cheapest_fitting(work, layout, cluster, features, space.recompute)
        if est is not None:
            results.append(est)
    results.sort(key=lambda e: (e.step_time, e.memory.total))
    return results


@dataclass(frozen=True)
class AblationRow:
    name: str
    cumulative: StepEstimate  # this and every earlier optimisation on
    alone: StepEstimate  # only this optimisation on, over the baseline


def ablate(
    work: Workload,
    gpus: int,
    cluster: ClusterSpec,
    base: SystemSpec,
    target: SystemSpec,
    lamb_scale: int = 4,
    layout: Layout | None = None,
    space: SearchSpace | None = None,
) -> list[AblationRow]:
    """MFU with each optimisation of `target` switched on over `base` in turn (MegaScale's
    Table 3), on one fixed layout, so every difference comes from the optimisation.

    The baseline runs `base` with AdamW at batch / lamb_scale; the last row switches to LAMB
    and multiplies the batch by `lamb_scale`. Without `layout` the layout is the best one for
    `target` at the baseline batch.
    """
    if work.global_batch % lamb_scale:
        raise ConfigError(f"--batch={work.global_batch} must be a multiple of --lamb-scale={lamb_scale}")
    small = replace(work, global_batch=work.global_batch // lamb_scale)
    if layout is None:
        best = search(target.apply(small), gpus, cluster, target.features, space)
        if not best:
            raise ConfigError(f"no layout of {gpus} GPUs fits {cluster.name} at batch {small.global_batch}")
        layout = best[0].layout
    adam = replace(base, optimizer="adamw")

    def run(system: SystemSpec, w: Workload = small) -> StepEstimate:
        return estimate(system.apply(w), layout, cluster, system.features)

    baseline = run(adam)
    rows = [AblationRow("baseline", baseline, baseline)]
    current = adam
    for name, current in ablation_steps(adam, target):
        rows.append(AblationRow(name, run(current), run(switch_on(adam, target, name))))
    lamb = replace(current, optimizer="lamb")
    large = replace(small, global_batch=small.global_batch * lamb_scale)
    rows.append(
        AblationRow(f"LAMB, batch x{lamb_scale}", run(lamb, large), run(replace(adam, optimizer="lamb"), large))
    )
    return rows
