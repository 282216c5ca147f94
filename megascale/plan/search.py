"""Enumerate the layouts a job could run with on N GPUs, predict each, rank them, and ablate.

A layout is kept if the trainer would accept it (`Layout.check`) and it fits in memory; among
recomputation choices only the cheapest that fits is kept, since recomputing more only adds
work. Ranking is by predicted step time (equivalently tokens/s and MFU at a fixed batch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megascale.config.schema import ConfigError
from megascale.plan.cluster import ClusterSpec
from megascale.plan.cost import StepEstimate, estimate
from megascale.plan.layout import Features, Layout, Workload

RECOMPUTE_ORDER = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)
MAX_VIRTUAL = 12


@dataclass(frozen=True)
class SearchSpace:
    zero_stages: tuple[int, ...] = (2,)  # MegaScale runs ZeRO-2
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    max_virtual: int = MAX_VIRTUAL
    max_tp: int | None = None  # default: GPUs per node (tensor parallelism stays on NVLink)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(work: Workload, gpus: int, cluster: ClusterSpec,
                      space: SearchSpace | None = None) -> list[Layout]:
    """Every layout of `gpus` ranks the trainer accepts (before the memory check)."""
    space = space or SearchSpace()
    m = work.model
    max_tp = min(space.max_tp or cluster.gpus_per_node, gpus)
    out: list[Layout] = []
    for tp in _divisors(max_tp):
        if cluster.gpus_per_node % tp:
            continue
        for pp in _divisors(m.layers):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for mb in space.micro_batches:
                if work.global_batch % (dp * mb):
                    continue
                virtuals = [1] if pp == 1 else [v for v in _divisors(m.layers // pp)
                                                 if v <= space.max_virtual]
                for v in virtuals:
                    for zero in space.zero_stages:
                        layout = Layout(dp=dp, tp=tp, pp=pp, v=v, micro_batch=mb,
                                        zero=zero if dp > 1 else 0)
                        try:
                            layout.check(work, cluster.gpus_per_node if gpus > 1 else None)
                        except ConfigError:
                            continue
                        out.append(layout)
    return sorted(set(out), key=Layout.label)


def cheapest_fitting(work: Workload, layout: Layout, cluster: ClusterSpec,
                     features: Features) -> StepEstimate | None:
    """The layout with the least recomputation that fits in memory, or None."""
    for recompute in RECOMPUTE_ORDER:
        est = estimate(work, replace(layout, recompute=recompute), cluster, features)
        if est.fits:
            return est
    return None


def search(work: Workload, gpus: int, cluster: ClusterSpec, features: Features | None = None,
           space: SearchSpace | None = None) -> list[StepEstimate]:
    """Fitting layouts, fastest first. Empty when nothing fits (more GPUs or a smaller model)."""
    features = features or Features()
    results = []
    for layout in candidate_layouts(work, gpus, cluster, space):
        est = cheapest_fitting(work, layout, cluster, features)
        if est is not None:
            results.append(est)
    results.sort(key=lambda e: (e.step_time, e.memory.total))
    return results


@dataclass(frozen=True)
class AblationRow:
    name: str
    cumulative: StepEstimate  # this and every earlier optimisation on
    alone: StepEstimate  # only this optimisation on, over the baseline


def ablate(work: Workload, gpus: int, cluster: ClusterSpec, swa_window: int | None = None,
           lamb_scale: int = 4, space: SearchSpace | None = None) -> list[AblationRow]:
    """MFU with each MegaScale optimisation turned on in turn (the paper's ablation, one row per optimisation).

    The baseline is a serial block, full attention, no overlaps and AdamW at batch/lamb_scale
    (the largest batch AdamW tolerates); LAMB's step multiplies the batch by `lamb_scale`. The
    layout is the best one for the baseline batch with everything else on, held fixed, so every
    difference comes from the optimisation, not from a different layout.
    """
    if work.global_batch % lamb_scale:
        raise ConfigError(
            f"--batch={work.global_batch} must be a multiple of --lamb-scale={lamb_scale}")
    window = swa_window or work.model.window or work.model.seq_len // 2
    small = replace(work, global_batch=work.global_batch // lamb_scale)
    best = search(small.with_model(window=window), gpus, cluster, Features(), space)
    if not best:
        raise ConfigError(
            f"no layout of {gpus} GPUs fits {cluster.name} at batch {small.global_batch}")
    layout = best[0].layout
    base_work = replace(small.with_model(block="serial", window=None), optimizer="adamw")
    off = Features.none()
    steps: list[tuple[str, dict, dict]] = [
        ("parallel block", {"block": "parallel"}, {}),
        (f"sliding window {window}", {"window": window}, {}),
        ("TP overlap", {}, {"tp_overlap": True}),
        ("PP overlap", {}, {"pp_overlap": True}),
        ("DP overlap", {}, {"dp_overlap": True, "data_overlap": True}),
        (f"LAMB, batch x{lamb_scale}", {"lamb": True}, {}),
    ]

    def apply(w: Workload, model_changes: dict) -> Workload:
        changes = dict(model_changes)
        if changes.pop("lamb", False):
            return replace(w, optimizer="lamb", global_batch=w.global_batch * lamb_scale)
        return w.with_model(**changes) if changes else w

    rows = [AblationRow("baseline", *(2 * [estimate(base_work, layout, cluster, off)]))]
    cum_work, cum_feat = base_work, off
    for name, model_changes, feature_changes in steps:
        cum_work = apply(cum_work, model_changes)
        cum_feat = replace(cum_feat, **feature_changes)
        alone = estimate(apply(base_work, model_changes), layout, cluster,
                         replace(off, **feature_changes))
        rows.append(AblationRow(name, estimate(cum_work, layout, cluster, cum_feat), alone))
    return rows
