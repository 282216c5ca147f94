"""`megascale plan`: predict, rank and explain layouts; ablate; place ranks; emit network env.

megascale plan --model configs/gpt-175b.toml --cluster a100-8x200g --gpus 12288 --batch 6144
megascale plan ... --layout dp=192,tp=8,pp=8,v=6,mb=1   # that layout only, no search
megascale plan ... --explain [LAYOUT]               # every term, its inputs, both FLOP counts
megascale plan ... --system megatron                # another system's switches and constants
megascale plan ... --ablate [BASELINE]              # baseline -> all on, one fixed layout
megascale plan ... --without stragglers,collisions  # drop effects to see their weight
megascale plan --calibrate RUN_DIR                  # fit the constants to a measured run
megascale plan ... --placement --ecmp --env         # rank order, ECMP figures, NCCL env
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from megascale.config import ConfigError, JobConfig, load_config
from megascale.layout.grid import RankGrid
from megascale.plan import ecmp, placement
from megascale.plan.calibrate import calibrate, format_calibration
from megascale.plan.cluster import ClusterSpec, list_presets, load_cluster
from megascale.plan.cost import TERMS, StepEstimate, estimate
from megascale.plan.env import communication_env, format_env
from megascale.plan.flops import CONVENTIONS
from megascale.plan.layout import Effects, Features, Layout, Workload
from megascale.plan.search import AblationRow, SearchSpace, ablate, cheapest_fitting, search
from megascale.plan.stragglers import jitter_from_run
from megascale.plan.system import SystemSpec, list_systems, load_system

LAYOUT_KEYS = {
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "v": "v",
    "vpp": "v",
    "mb": "micro_batch",
    "micro_batch": "micro_batch",
    "zero": "zero",
    "rc": "recompute",
    "recompute": "recompute",
    "ep": "ep",
    "schedule": "schedule",  # 1f1b, zb-h1 or zbv (parallel.schedule)
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        "--config",
        dest="config",
        default="configs/gpt-175b.toml",
        help="job/model TOML (its [model], [train], [optim], [parallel])",
    )
    parser.add_argument(
        "--cluster", default="a100-8x200g", help=f"preset ({', '.join(list_presets())}) or a cluster TOML"
    )
    parser.add_argument(
        "--system",
        help=f"system preset ({', '.join(list_systems())}) or TOML: "
        "its optimisations replace the job's (default: the job as configured, "
        "with megascale's implementation constants)",
    )
    parser.add_argument("--gpus", type=int, help="GPUs to plan for (default: the config's layout)")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default: config)")
    parser.add_argument(
        "--layout",
        help="evaluate exactly this layout, e.g. dp=192,tp=8,pp=8,v=6,"
        "mb=1[,zero=2,rc=none,schedule=zb-h1]; without rc, the least recomputation that fits",
    )
    parser.add_argument("--top", type=int, default=5, help="how many layouts to print")
    parser.add_argument("--zero", help="ZeRO stages to consider, e.g. 1,2 (default: the system's)")
    parser.add_argument("--tp-chunks", type=int, help="chunks of the TP GEMM overlap")
    for name in ("tp", "pp", "dp"):
        parser.add_argument(
            f"--no-{name}-overlap", action="store_true", help=f"model the step without the {name.upper()} overlap"
        )
    parser.add_argument(
        "--without",
        default="",
        metavar="EFFECTS",
        help=f"effects to leave out, comma-separated: {', '.join(Effects.NAMES)}",
    )
    parser.add_argument(
        "--jitter-from", metavar="RUN_DIR", help="take the per-rank jitter from this run's timer database"
    )
    parser.add_argument(
        "--explain",
        nargs="?",
        const="best",
        metavar="LAYOUT",
        help="print every term of the best layout (or of --layout / LAYOUT)",
    )
    parser.add_argument(
        "--ablate",
        nargs="?",
        const="megatron",
        metavar="BASELINE",
        help="walk from BASELINE (default megatron) to --system (default "
        "megascale), one optimisation at a time, on --layout if given",
    )
    parser.add_argument("--swa-window", type=int, help="window of the ablation's SWA step")
    parser.add_argument("--lamb-scale", type=int, help="batch growth LAMB allows (default: the system's)")
    parser.add_argument(
        "--calibrate", nargs="+", metavar="RUN_DIR", help="fit the efficiency constants to these runs' timer databases"
    )
    parser.add_argument("--placement", action="store_true", help="print the launcher rank order")
    parser.add_argument("--hosts", help="host list, one 'name tor [pod]' per line")
    parser.add_argument("--placement-out", help="write the host order (one per line) here")
    parser.add_argument("--ecmp", action="store_true", help="ECMP collision model of DP traffic")
    parser.add_argument("--ecmp-trials", type=int, default=20)
    parser.add_argument("--env", action="store_true", help="print the communication environment")
    parser.add_argument("--json", help="write the results as JSON to this path")


def parse_layout(text: str, base: Layout, gpus: int | None = None) -> tuple[Layout, bool]:
    """(layout, whether rc was given). dp may be left out when `gpus` is known."""
    changes: dict[str, Any] = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        if key not in LAYOUT_KEYS or not value:
            raise ConfigError(f"layout: {item!r} is not key=value with key in {sorted(LAYOUT_KEYS)}")
        field = LAYOUT_KEYS[key]
        try:
            changes[field] = value if field in ("recompute", "schedule") else int(value)
        except ValueError as exc:
            raise ConfigError(f"layout: {key}={value!r} must be an integer") from exc
    layout = replace(base, **changes)
    if "dp" not in changes and gpus:
        if gpus % (layout.tp * layout.pp):
            raise ConfigError(f"layout: tp*pp={layout.tp * layout.pp} does not divide --gpus={gpus}")
        layout = replace(layout, dp=gpus // (layout.tp * layout.pp))
    if gpus and layout.world != gpus:
        raise ConfigError(f"layout {layout.label()} uses {layout.world} GPUs, not --gpus={gpus}")
    return replace(layout, zero=layout.zero if layout.dp > 1 else 0), "recompute" in changes


def evaluate(
    work: Workload, layout: Layout, cluster: ClusterSpec, features: Features, recompute_given: bool = True
) -> StepEstimate:
    """One layout without a search: exactly as given, or with the least recomputation that fits
    (as the search does) when the recomputation was not given."""
    if recompute_given:
        return estimate(work, layout, cluster, features)
    fitting = cheapest_fitting(work, layout, cluster, features)
    return fitting or estimate(work, replace(layout, recompute="full"), cluster, features)


# --- rendering: plain text and JSON, kept apart from the arithmetic ---

GIB = 1024**3
SHOWN = ("compute", "tp_exposed", "bubble", "pp_exposed", "dp_exposed", "stragglers")


def ranking_table(results: list[StepEstimate], top: int) -> str:
    head = (
        f"{'#':>2} {'layout':<44} {'step s':>8} {'tok/s':>10} {'MFU':>6} {'mem GiB':>8} | "
        + " ".join(f"{t[:10]:>10}" for t in SHOWN)
        + f" {'rest':>8}"
    )
    lines = [head, "-" * len(head)]
    for i, est in enumerate(results[:top], 1):
        bd = est.breakdown()
        rest = est.step_time - sum(bd[t] for t in SHOWN)
        lines.append(
            f"{i:>2} {est.layout.label():<44} {est.step_time:>8.3f} {est.tokens_per_s:>10.0f} "
            f"{est.mfu:>6.1%} {est.memory.total / GIB:>8.1f} | "
            + " ".join(f"{bd[t]:>10.3f}" for t in SHOWN)
            + f" {rest:>8.3f}"
        )
    return "\n".join(lines)


def explain(est: StepEstimate) -> str:
    """Every term of one layout's prediction, with what it is made of."""
    lay, d, f = est.layout, est.detail, est.features
    bd = est.breakdown()
    effects = [n for n in Effects.NAMES if getattr(f.effects, n)]
    lines = [
        f"layout            {lay.label()}  ({lay.world} GPUs, {est.micro_batches} micro-batches)",
        f"overlaps          tp={f.tp_overlap} (chunks {f.tp_chunks}) pp={f.pp_overlap} "
        f"dp={f.dp_overlap} data={f.data_overlap}",
        f"operators         attention {f.attention}, fused element-wise {f.fused_elementwise}",
        f"implementation    {f.impl}",
        f"effects modelled  {', '.join(effects) or 'none'}",
        f"step time         {est.step_time:.4f} s   tokens/s {est.tokens_per_s:,.0f}",
        "MFU by FLOP convention:",
        *(f"  {c:<9} {est.mfu_in(c):>7.2%}  {label}" for c, label in CONVENTIONS.items()),
        "",
        "per micro-batch, slowest stage (one GPU):",
        f"  layers/stage    {int(d['layers_per_stage'])}, {int(d['kernels_per_layer'])} kernels per layer forward",
        f"  layer fwd       {d['layer_fwd'] * 1e3:.3f} ms  (GEMM {d['gemm_fwd'] * 1e3:.3f}, "
        f"attention {d['attention_fwd'] * 1e3:.3f}, element-wise {d['elementwise_fwd'] * 1e3:.3f})",
        f"  layer bwd       {d['layer_bwd'] * 1e3:.3f} ms",
        f"  head fwd        {d['head_fwd'] * 1e3:.3f} ms",
        f"  fwd / bwd       {d['fwd_mb'] * 1e3:.2f} / {d['bwd_mb'] * 1e3:.2f} ms; busy {d['busy_mb'] * 1e3:.2f} ms",
        f"  TP collective   {d['tp_collective'] * 1e3:.3f} ms each (all-gather = reduce-scatter)",
    ]
    if "dp_link_gbps" in d:
        scope = next(k[len("dp_scope_") :] for k in d if k.startswith("dp_scope_"))
        per_layer = d.get("dp_allgather_layer", d.get("dp_allreduce_layer", 0.0))
        lines.append(
            f"  DP ring         {d['dp_link_gbps']:.1f} GB/s bus bandwidth, spans a "
            f"{scope}; {per_layer * 1e3:.3f} ms per layer collective"
        )
    lines += ["", "step terms (s)      exposed      issued"]
    issued = {"tp_exposed": est.totals["tp"], "pp_exposed": est.totals["pp"], "dp_exposed": est.totals["dp"]}
    for term in TERMS:
        extra = f"{issued[term]:>11.4f}" if term in issued else ""
        lines.append(f"  {term:<16} {bd[term]:>10.4f} {extra}")
    if est.terms["compute"] > 0:
        ratio = est.terms["bubble"] / d["busy_mb"] / est.micro_batches
        lines.append(f"  bubble / busy = {ratio:.4f}  ((p-1)/(v*m) = {(lay.pp - 1) / (lay.v * est.micro_batches):.4f})")
    lines += ["", "inputs of the effects:"]
    lines += [f"  {k:<16} {v}" for k, v in est.inputs.items()]
    lines += ["", "memory per GPU (GiB):"]
    for key, value in est.memory.as_dict().items():
        lines.append(f"  {key:<16} {value / GIB:>8.2f}")
    lines.append(f"  fits            {est.fits}")
    return "\n".join(lines)


def ablation_table(rows: list[AblationRow]) -> str:
    lines = [
        f"layout: {rows[0].cumulative.layout.label()}",
        f"{'optimisation':<32} {'MFU causal':>10} {'MFU full':>9} {'step s':>9} {'tok/s':>10} {'alone (full)':>12}",
    ]
    for row in rows:
        c = row.cumulative
        lines.append(
            f"{row.name:<32} {c.mfu:>10.1%} {c.mfu_in('full'):>9.1%} {c.step_time:>9.3f} "
            f"{c.tokens_per_s:>10.0f} {row.alone.mfu_in('full'):>12.1%}"
        )
    lines.append(
        "(causal MFU counts the FLOPs the model needs: a sliding window lowers them, so it "
        "shows in tokens/s more than in MFU)"
    )
    return "\n".join(lines)


def estimate_json(est: StepEstimate) -> dict[str, Any]:
    lay = est.layout
    return {
        "layout": {
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "v": lay.v,
            "micro_batch": lay.micro_batch,
            "zero": lay.zero,
            "recompute": lay.recompute,
            "cp": lay.cp,
            "ep": lay.ep,
            "schedule": lay.schedule,
        },
        "step_time_s": est.step_time,
        "tokens_per_s": est.tokens_per_s,
        "mfu": est.mfu,
        "mfu_by_convention": {c: est.mfu_in(c) for c in CONVENTIONS},
        "breakdown_s": est.breakdown(),
        "issued_comm_s": est.totals,
        "effects": est.inputs,
        "memory_gib": {k: v / GIB for k, v in est.memory.as_dict().items()},
        "fits": est.fits,
    }


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigError as exc:
        print(f"megascale plan: {exc}")
        return 2


def job_features(args: argparse.Namespace, cfg: JobConfig, system: SystemSpec) -> Features:
    """The job's (or --system's) switches, the system's constants, the command's overrides."""
    if args.system:
        features = system.features
    else:
        base = system.features
        features = replace(
            Features.from_job(cfg), attention=base.attention, fused_elementwise=base.fused_elementwise, impl=base.impl
        )
    impl = features.impl
    if args.jitter_from:
        from megascale.diagnostics.store import default_db_path

        impl = replace(impl, jitter=jitter_from_run(default_db_path(args.jitter_from)))
    return replace(
        features,
        impl=impl,
        effects=Effects.without([n for n in args.without.split(",") if n]),
        tp_chunks=args.tp_chunks or features.tp_chunks,
        tp_overlap=features.tp_overlap and not args.no_tp_overlap,
        pp_overlap=features.pp_overlap and not args.no_pp_overlap,
        dp_overlap=features.dp_overlap and not args.no_dp_overlap,
    )


def _run(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.cluster)
    if args.calibrate:
        fit = calibrate(args.calibrate, cluster)
        print(format_calibration(fit))
        if args.json:
            Path(args.json).write_text(json.dumps(fit.as_dict(), indent=2))
        return 0
    cfg = load_config(args.config, args.overrides)
    if cfg.train.memory_limit_gib:  # the job's own limit: every layout is judged against it
        gpu = cluster.gpu
        limit = min(gpu.memory_bytes, gpu.reserved_bytes + cfg.train.memory_limit_gib * GIB)
        cluster = replace(cluster, gpu=replace(gpu, memory_bytes=limit))
        print(
            f"train.memory_limit_gib={cfg.train.memory_limit_gib:g}: a layout fits in {limit / GIB:.1f} GiB "
            "per GPU (with the GPU's reserved memory)"
        )
    system = load_system(args.system or "megascale")
    work = Workload.from_job(cfg, args.batch)
    if args.system:
        work = system.apply(work)
    gpus = args.gpus or RankGrid.of(cfg.parallel).world_size
    features = job_features(args, cfg, system)
    zeros = tuple(int(z) for z in args.zero.split(",")) if args.zero else ((system.zero,) if args.system else (2,))
    space = SearchSpace(zero_stages=zeros)
    out: dict[str, object] = {
        "cluster": cluster.name,
        "system": args.system or "job config",
        "gpus": gpus,
        "batch": work.global_batch,
    }
    print(f"{cluster.name}: {cluster.notes}")
    if args.system:
        print(f"system {system.name}: {system.notes}")
    print(
        f"model {args.config}: {work.model.layers} layers, hidden {work.model.hidden}, "
        f"seq {work.model.seq_len}, block {work.model.block}, window {work.model.window}; "
        f"{gpus} GPUs, batch {work.global_batch}\n"
    )

    layout_text = args.layout or (args.explain if args.explain not in (None, "best") else None)
    fixed = None
    if layout_text:
        layout, rc_given = parse_layout(layout_text, Layout(dp=1, zero=zeros[0]), gpus)
        best = evaluate(work, layout, cluster, features, rc_given)
        fixed = best.layout
        print(ranking_table([best], 1))
        out["layout"] = estimate_json(best)
    else:
        results = search(work, gpus, cluster, features, space)
        if not results:
            print(f"no layout of {gpus} GPUs fits: try more GPUs, ZeRO-3 (--zero 3) or a bigger GPU")
            return 1
        print(ranking_table(results, args.top))
        out["ranking"] = [estimate_json(e) for e in results[: args.top]]
        best = results[0]
    if args.explain:
        print("\n" + explain(best))
        out["explain"] = estimate_json(best)
    if args.ablate:
        target = load_system(args.system or "megascale")
        if args.swa_window:
            target = replace(target, window=args.swa_window)
        base, target = (s.with_effects(features.effects) for s in (load_system(args.ablate), target))
        rows = ablate(
            Workload.from_job(cfg, args.batch),
            gpus,
            cluster,
            base,
            target,
            args.lamb_scale or target.lamb_scale,
            fixed,
            space,
        )
        print(f"\nablation {base.name} -> {target.name}:\n" + ablation_table(rows))
        out["ablation"] = [
            {
                "name": r.name,
                "mfu": r.cumulative.mfu,
                "mfu_full": r.cumulative.mfu_in("full"),
                "alone_mfu_full": r.alone.mfu_in("full"),
                "step_time_s": r.cumulative.step_time,
            }
            for r in rows
        ]
    if args.placement or args.ecmp or args.placement_out:
        out |= _placement(args, best.layout, cluster, work, features)
    if args.env:
        print("\n# communication environment for this job (docs/planning.md)")
        print(format_env(communication_env(best.step_time)))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


def _placement(
    args: argparse.Namespace, layout: Layout, cluster: ClusterSpec, work: Workload, features: Features
) -> dict[str, object]:
    gpn = cluster.gpus_per_node
    nodes = cluster.nodes_for(layout.world)
    hosts = placement.read_hosts(args.hosts) if args.hosts else placement.synthetic_hosts(cluster, nodes)
    placed = placement.place(layout, hosts, gpn)
    naive = placement.scheduler_order(layout, hosts, gpn)
    out: dict[str, object] = {"placement": placement.describe(placed), "scheduler_order": placement.describe(naive)}
    print(f"\nplacement of {layout.label()} on {nodes} nodes:")
    for name, p in (("topology-aware", placed), ("scheduler order", naive)):
        d = placement.describe(p)
        print(
            f"  {name:<16} dp group spans {d['dp_group_tors_mean']:.2f} ToRs on average "
            f"(max {d['dp_group_tors_max']}), tp group spans <= {d['tp_group_nodes_max']} node"
        )
    order = placed.rank_order()
    if args.placement:
        shown = order if len(order) <= 16 else order[:8] + ["..."] + order[-4:]
        print(f"  launcher order (node rank k runs ranks k*{gpn}..k*{gpn}+{gpn - 1}): " + " ".join(shown))
    if args.placement_out:
        Path(args.placement_out).write_text("\n".join(order) + "\n")
        print(f"  host order written to {args.placement_out}")
    if args.ecmp:
        print(f"\nECMP model of the DP ring traffic ({args.ecmp_trials} hash draws):")
        rows = []
        for name, p in (("topology-aware", placed), ("scheduler order", naive)):
            for split in (True, False):
                res = ecmp.simulate(p, ecmp.Fabric.of(cluster, split), args.ecmp_trials)
                slowed = estimate(work, layout, cluster, replace(features, network_slowdown=res.slowdown))
                rows.append(
                    {
                        "placement": name,
                        "split_downlinks": split,
                        "slowdown": res.slowdown,
                        "worst": res.worst_slowdown,
                        "collided_flows": res.collided_flows,
                        "cross_tor_flows": res.cross_tor_flows,
                        "mfu": slowed.mfu,
                    }
                )
                print(
                    f"  {name:<16} {'2x200G split' if split else 'unsplit     '} "
                    f"cross-ToR flows {res.cross_tor_flows:>6}/{res.network_flows:<6} "
                    f"slowed {res.collided_flows:>6.2%}  DP slowdown {res.slowdown:.2f}x "
                    f"(worst {res.worst_slowdown:.2f}x)  MFU {slowed.mfu:.1%}"
                )
        out["ecmp"] = rows
    return out
