"""`megascale plan`: predict, rank and explain layouts; ablate; place ranks; emit network env.

    megascale plan --model configs/gpt-175b.toml --cluster a100-8x200g --gpus 12288 --batch 6144
    megascale plan ... --explain                      # every term of the best layout
    megascale plan ... --explain dp=192,tp=8,pp=8,v=2,mb=1
    megascale plan ... --ablate                       # each optimisation turned on in turn
    megascale plan ... --placement --ecmp --env       # rank order, ECMP figures, NCCL env
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from megascale.config import ConfigError, load_config
from megascale.plan import ecmp, placement
from megascale.plan.cluster import list_presets, load_cluster
from megascale.plan.cost import StepEstimate, estimate
from megascale.plan.env import communication_env, format_env
from megascale.plan.layout import Features, Layout, Workload
from megascale.plan.search import AblationRow, SearchSpace, ablate, search

LAYOUT_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "v": "v", "vpp": "v", "mb": "micro_batch",
               "micro_batch": "micro_batch", "zero": "zero", "rc": "recompute",
               "recompute": "recompute"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--config", dest="config", default="configs/gpt-175b.toml",
                        help="job/model TOML (its [model], [train], [optim], [parallel])")
    parser.add_argument("--cluster", default="a100-8x200g",
                        help=f"preset ({', '.join(list_presets())}) or a cluster TOML")
    parser.add_argument("--gpus", type=int, help="GPUs to plan for (default: the config's layout)")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default: config)")
    parser.add_argument("--top", type=int, default=5, help="how many layouts to print")
    parser.add_argument("--zero", default="2", help="ZeRO stages to consider, e.g. 1,2")
    parser.add_argument("--tp-chunks", type=int, help="chunks of the TP GEMM overlap")
    for name in ("tp", "pp", "dp"):
        parser.add_argument(f"--no-{name}-overlap", action="store_true",
                            help=f"model the step without the {name.upper()} overlap")
    parser.add_argument("--explain", nargs="?", const="best", metavar="LAYOUT",
                        help="print every term of the best layout or of e.g. dp=4,tp=8,pp=8,v=2")
    parser.add_argument("--ablate", action="store_true", help="MFU with each optimisation in turn")
    parser.add_argument("--swa-window", type=int, help="window for the ablation (default seq/2)")
    parser.add_argument("--lamb-scale", type=int, default=4, help="batch growth LAMB allows")
    parser.add_argument("--placement", action="store_true", help="print the launcher rank order")
    parser.add_argument("--hosts", help="host list, one 'name tor [pod]' per line")
    parser.add_argument("--placement-out", help="write the host order (one per line) here")
    parser.add_argument("--ecmp", action="store_true", help="ECMP collision model of DP traffic")
    parser.add_argument("--ecmp-trials", type=int, default=20)
    parser.add_argument("--env", action="store_true", help="print the communication environment")
    parser.add_argument("--json", help="write the results as JSON to this path")


def parse_layout(text: str, base: Layout) -> Layout:
    changes: dict[str, object] = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        if key not in LAYOUT_KEYS or not value:
            raise ConfigError(
                f"--explain: {item!r} is not key=value with key in {sorted(LAYOUT_KEYS)}")
        field = LAYOUT_KEYS[key]
        changes[field] = value if field == "recompute" else int(value)
    return replace(base, **changes)


# --- rendering: plain text and JSON, kept apart from the arithmetic ---

GIB = 1024**3
TERMS = ("compute", "recompute", "tp_exposed", "bubble", "pp_exposed", "dp_exposed",
         "optimizer", "other")


def ranking_table(results: list[StepEstimate], top: int) -> str:
    head = (f"{'#':>2} {'layout':<44} {'step s':>8} {'tok/s':>10} {'MFU':>6} {'mem GiB':>8} | "
            + " ".join(f"{t[:10]:>10}" for t in TERMS))
    lines = [head, "-" * len(head)]
    for i, est in enumerate(results[:top], 1):
        bd = est.breakdown()
        lines.append(
            f"{i:>2} {est.layout.label():<44} {est.step_time:>8.3f} {est.tokens_per_s:>10.0f} "
            f"{est.mfu:>6.1%} {est.memory.total / GIB:>8.1f} | "
            + " ".join(f"{bd[t]:>10.3f}" for t in TERMS))
    return "\n".join(lines)


def explain(est: StepEstimate) -> str:
    """Every term of one layout's prediction, with what it is made of."""
    lay, d = est.layout, est.detail
    bd = est.breakdown()
    lines = [
        f"layout            {lay.label()}  ({lay.world} GPUs, {est.micro_batches} micro-batches)",
        f"features          {est.features}",
        f"step time         {est.step_time:.4f} s   tokens/s {est.tokens_per_s:,.0f}   "
        f"MFU {est.mfu:.2%}",
        "",
        "per micro-batch, slowest stage (one GPU):",
        f"  layers/stage    {int(d['layers_per_stage'])}",
        f"  layer fwd       {d['layer_fwd'] * 1e3:.3f} ms  (GEMM {d['gemm_fwd'] * 1e3:.3f}, "
        f"attention {d['attention_fwd'] * 1e3:.3f}, element-wise {d['elementwise_fwd'] * 1e3:.3f})",
        f"  layer bwd       {d['layer_bwd'] * 1e3:.3f} ms",
        f"  head fwd        {d['head_fwd'] * 1e3:.3f} ms",
        f"  fwd / bwd       {d['fwd_mb'] * 1e3:.2f} / {d['bwd_mb'] * 1e3:.2f} ms",
        f"  TP collective   {d['tp_collective'] * 1e3:.3f} ms each (all-gather = reduce-scatter)",
    ]
    if "dp_link_gbps" in d:
        scope = next(k[len("dp_scope_"):] for k in d if k.startswith("dp_scope_"))
        per_layer = d.get("dp_allgather_layer", d.get("dp_allreduce_layer", 0.0))
        lines.append(f"  DP ring         {d['dp_link_gbps']:.1f} GB/s bus bandwidth, spans a "
                     f"{scope}; {per_layer * 1e3:.3f} ms per layer collective")
    lines += ["", "step terms (s)      exposed      issued"]
    issued = {"tp_exposed": est.totals["tp"], "pp_exposed": est.totals["pp"],
              "dp_exposed": est.totals["dp"]}
    for term in TERMS:
        extra = f"{issued[term]:>11.4f}" if term in issued else ""
        lines.append(f"  {term:<16} {bd[term]:>10.4f} {extra}")
    if est.compute > 0:
        ratio = est.bubble / (est.compute + est.tp_exposed)
        lines.append(f"  bubble / (compute + tp) = {ratio:.4f}"
                     f"  ((p-1)/(v*m) = "
                     f"{(lay.pp - 1) / (lay.v * est.micro_batches):.4f})")
    lines += ["", "memory per GPU (GiB):"]
    for key, value in est.memory.as_dict().items():
        lines.append(f"  {key:<16} {value / GIB:>8.2f}")
    lines.append(f"  fits            {est.fits}")
    return "\n".join(lines)


def ablation_table(rows: list[AblationRow]) -> str:
    lines = [f"layout: {rows[0].cumulative.layout.label()}",
             f"{'optimisation':<26} {'cumulative MFU':>15} {'step s':>9} {'tok/s':>10} "
             f"{'alone MFU':>10}"]
    for row in rows:
        c = row.cumulative
        lines.append(f"{row.name:<26} {c.mfu:>15.1%} {c.step_time:>9.3f} {c.tokens_per_s:>10.0f} "
                     f"{row.alone.mfu:>10.1%}")
    lines.append("(MFU counts the FLOPs the model needs: a sliding window lowers them, so it "
                 "shows in tokens/s more than in MFU)")
    return "\n".join(lines)


def estimate_json(est: StepEstimate) -> dict[str, Any]:
    lay = est.layout
    return {
        "layout": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "v": lay.v,
                   "micro_batch": lay.micro_batch, "zero": lay.zero, "recompute": lay.recompute},
        "step_time_s": est.step_time, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
        "breakdown_s": est.breakdown(), "issued_comm_s": est.totals,
        "memory_gib": {k: v / GIB for k, v in est.memory.as_dict().items()}, "fits": est.fits,
    }


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigError as exc:
        print(f"megascale plan: {exc}")
        return 2


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    cluster = load_cluster(args.cluster)
    work = Workload.from_job(cfg, args.batch)
    gpus = args.gpus or cfg.parallel.world_size
    features = Features.from_job(cfg)
    features = replace(
        features,
        tp_chunks=args.tp_chunks or features.tp_chunks,
        tp_overlap=features.tp_overlap and not args.no_tp_overlap,
        pp_overlap=not args.no_pp_overlap,
        dp_overlap=features.dp_overlap and not args.no_dp_overlap,
    )
    space = SearchSpace(zero_stages=tuple(int(z) for z in args.zero.split(",")))
    out: dict[str, object] = {"cluster": cluster.name, "gpus": gpus, "batch": work.global_batch}
    print(f"{cluster.name}: {cluster.notes}")
    print(f"model {args.config}: {work.model.layers} layers, hidden {work.model.hidden}, "
          f"seq {work.model.seq_len}, block {work.model.block}, window {work.model.window}; "
          f"{gpus} GPUs, batch {work.global_batch}\n")

    results = search(work, gpus, cluster, features, space)
    if not results:
        print(f"no layout of {gpus} GPUs fits: try more GPUs, ZeRO-3 (--zero 3) or a bigger GPU")
        return 1
    print(ranking_table(results, args.top))
    out["ranking"] = [estimate_json(e) for e in results[:args.top]]
    best: StepEstimate = results[0]

    if args.explain:
        chosen = best if args.explain == "best" else estimate(
            work, parse_layout(args.explain, Layout(dp=1)), cluster, features)
        print("\n" + explain(chosen))
        out["explain"] = estimate_json(chosen)
        best = chosen
    if args.ablate:
        rows = ablate(work, gpus, cluster, args.swa_window, args.lamb_scale, space)
        print("\n" + ablation_table(rows))
        out["ablation"] = [{"name": r.name, "mfu": r.cumulative.mfu, "alone_mfu": r.alone.mfu,
                            "step_time_s": r.cumulative.step_time} for r in rows]
    if args.placement or args.ecmp or args.placement_out:
        out |= _placement(args, best.layout, cluster, work, features)
    if args.env:
        print("\n# communication environment for this job (docs/planning.md)")
        print(format_env(communication_env(best.step_time)))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


def _placement(args: argparse.Namespace, layout: Layout, cluster, work: Workload,
               features: Features) -> dict[str, object]:
    gpn = cluster.gpus_per_node
    nodes = cluster.nodes_for(layout.world)
    hosts = placement.read_hosts(args.hosts) if args.hosts else placement.synthetic_hosts(
        cluster, nodes)
    placed = placement.place(layout, hosts, gpn)
    naive = placement.scheduler_order(layout, hosts, gpn)
    out: dict[str, object] = {"placement": placement.describe(placed),
                              "scheduler_order": placement.describe(naive)}
    print(f"\nplacement of {layout.label()} on {nodes} nodes:")
    for name, p in (("topology-aware", placed), ("scheduler order", naive)):
        d = placement.describe(p)
        print(f"  {name:<16} dp group spans {d['dp_group_tors_mean']:.2f} ToRs on average "
              f"(max {d['dp_group_tors_max']}), tp group spans <= {d['tp_group_nodes_max']} node")
    order = placed.rank_order()
    if args.placement:
        shown = order if len(order) <= 16 else order[:8] + ["..."] + order[-4:]
        print(f"  launcher order (node rank k runs ranks k*{gpn}..k*{gpn}+{gpn - 1}): "
              + " ".join(shown))
    if args.placement_out:
        Path(args.placement_out).write_text("\n".join(order) + "\n")
        print(f"  host order written to {args.placement_out}")
    if args.ecmp:
        print(f"\nECMP model of the DP ring traffic ({args.ecmp_trials} hash draws):")
        rows = []
        for name, p in (("topology-aware", placed), ("scheduler order", naive)):
            for split in (True, False):
                res = ecmp.simulate(p, ecmp.Fabric.of(cluster, split), args.ecmp_trials)
                slowed = estimate(work, layout, cluster,
                                  replace(features, network_slowdown=res.slowdown))
                rows.append({"placement": name, "split_downlinks": split,
                             "slowdown": res.slowdown, "worst": res.worst_slowdown,
                             "collided_flows": res.collided_flows,
                             "cross_tor_flows": res.cross_tor_flows, "mfu": slowed.mfu})
                print(f"  {name:<16} {'2x200G split' if split else 'unsplit     '} "
                      f"cross-ToR flows {res.cross_tor_flows:>6}/{res.network_flows:<6} "
                      f"slowed {res.collided_flows:>6.2%}  DP slowdown {res.slowdown:.2f}x "
                      f"(worst {res.worst_slowdown:.2f}x)  MFU {slowed.mfu:.1%}")
        out["ecmp"] = rows
    return out
