"""Plain-text and JSON renderings of the planner's answers (kept apart from the arithmetic)."""

from __future__ import annotations

from typing import Any

from megascale.plan.cost import StepEstimate
from megascale.plan.search import AblationRow

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
