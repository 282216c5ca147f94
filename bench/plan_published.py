"""The planner against published large-scale training throughput: one row per published figure.

Each row is a figure a paper or a project reported, with the model, GPU count, batch and as much
of the layout as the source states; what it does not state (the interleaving degree v, the
micro-batch, the recomputation) is searched over, so the prediction is the planner's best for the
stated constraints. Every row is predicted with the constants of its system preset
(`configs/systems/`) and cluster preset (`configs/clusters/`): one set per system and hardware,
never per row. The published figure and the prediction are compared in the FLOP convention the
source used (`megascale/plan/flops.py`), as % of peak. Writes bench/results/plan_published.json;
`--markdown` prints the table for docs/planning.md.

    python bench/plan_published.py [--markdown] [--only megascale-t2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from megascale.config import ModelConfig
from megascale.plan.cluster import ClusterSpec, load_cluster
from megascale.plan.cost import StepEstimate
from megascale.plan.layout import Workload
from megascale.plan.search import SearchSpace, ablate, search
from megascale.plan.system import SystemSpec, load_system

ROOT = Path(__file__).resolve().parents[1]
GOAL_POINTS = 3.0

SC21 = (
    "Narayanan et al., SC'21 (arXiv:2104.04473), Table 1; same figures in NVIDIA/Megatron-LM "
    "README @61fcc028e3, images/cases_april2021.png"
)
SC21_T2 = "Narayanan et al., SC'21 (arXiv:2104.04473), Table 2 (PTD parallelism rows)"
SC21_README = (
    "NVIDIA/Megatron-LM README @61fcc028e3, 'GPT-3 Example' "
    "(examples/pretrain_gpt3_175B.sh: tp 8, pp 16, micro-batch 1, batch 1536)"
)
MS_T2 = "Jiang et al., MegaScale, NSDI'24 (arXiv:2402.15627v1), Table 2"
MS_F9 = "Jiang et al., MegaScale, NSDI'24 (arXiv:2402.15627v1), Figure 9 (bar labels)"
MS_T3 = "Jiang et al., MegaScale, NSDI'24 (arXiv:2402.15627v1), Table 3"
KORTHIKANTI = (
    "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', "
    "MLSys'23 (arXiv:2205.05198), abstract: 530B GPT on 2240 A100s, MFU 54.2% with sequence "
    "parallelism + selective recomputation, 42.1% with full recomputation"
)
TITAN = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024), Tables 1 and 3, TPS/GPU without Float8"
)


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelConfig:
    """A GPT-3-style model as Megatron-LM and MegaScale train it (learned positions, biases).
    Megatron ties the head to the embedding; our trainer cannot under pp > 1, so the head is
    untied here: the same FLOPs, one vocabulary matrix more in memory on the last stage."""
    return ModelConfig(
        vocab_size=vocab, seq_len=2048, layers=layers, hidden=hidden, heads=heads, block="serial", positions="learned"
    )


# Llama 3.1 8B as a FLOP-equivalent GPT: SwiGLU (3 x 4096 x 14336) and grouped-query attention
# (8 KV heads) have the dense FLOPs and parameters of a 2-matrix MLP of width 18432 with full QKV.
LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    seq_len=8192,
    layers=32,
    hidden=4096,
    heads=32,
    ffn_hidden=18432,
    block="serial",
    positions="rotary",
    bias=False,
)
MS_175B, MS_530B = gpt(96, 12288, 128, 64000), gpt(105, 20480, 160, 64000)


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    system: str
    cluster: str
    model: ModelConfig
    gpus: int
    batch: int
    published: float  # % of peak, in `convention`
    convention: str
    reported: str  # the figure as the source printed it
    tp: int
    pp: int
    v: tuple[int, ...] | None = None  # None: searched
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero: int | None = None  # None: the system's
    note: str = ""
    extra: dict = field(default_factory=dict)


def sc21(layers: int, hidden: int, heads: int, tp: int, pp: int, gpus: int, batch: int, tflops: int) -> Row:
    return Row(
        f"sc21-{gpus}",
        SC21,
        "megatron-2021",
        "a100-8x200g",
        gpt(layers, hidden, heads),
        gpus,
        batch,
        100 * tflops / 312,
        "megatron",
        f"{tflops} TFLOP/s per GPU",
        tp,
        pp,
        recompute=("full",),
    )


def megascale_t2(system: str, gpus: int, batch: int, mfu: float) -> Row:
    return Row(
        f"ms-t2-{system}-{gpus}",
        MS_T2,
        system,
        "a100-8x200g",
        MS_175B,
        gpus,
        batch,
        mfu,
        "full",
        f"MFU {mfu}%",
        8,
        8,
        v=(6,),
    )


def megascale_f9(system: str, gpus: int, mfu: float) -> Row:
    return Row(
        f"ms-f9-{system}-{gpus}",
        MS_F9,
        system,
        "a100-8x200g",
        MS_530B,
        gpus,
        gpus,
        mfu,
        "full",
        f"MFU {mfu}%",
        8,
        35,
        v=(3,),
    )


def titan(gpus: int, tps: int) -> Row:
    return Row(
        f"titan-8b-{gpus}",
        TITAN,
        "torchtitan",
        "h100-8x400g",
        LLAMA3_8B,
        gpus,
        2 * gpus,
        100 * tps * 0,
        "full",
        f"{tps} TPS/GPU",
        1,
        1,
        micro_batch=(2,),
        recompute=("selective",),
        zero=3,
        note="H100 SXM at a 500 W cap with HBM2e (torchtitan's note 2): peak below the 989 TFLOP/s the preset assumes",
        extra={"tps": tps},
    )


ROWS: list[Row] = [
    sc21(24, 2304, 24, 1, 1, 32, 512, 137),
    sc21(30, 3072, 32, 2, 1, 64, 512, 138),
    sc21(36, 4096, 32, 4, 1, 128, 512, 142),
    sc21(40, 6144, 48, 8, 1, 256, 1024, 135),
    sc21(48, 8192, 64, 8, 2, 512, 1536, 138),
    sc21(60, 10240, 80, 8, 4, 1024, 1792, 140),
    sc21(80, 12288, 96, 8, 8, 1536, 2304, 148),
    sc21(96, 16384, 128, 8, 16, 1920, 2160, 155),
    sc21(105, 20480, 128, 8, 35, 2520, 2520, 163),
    sc21(128, 25600, 160, 8, 64, 3072, 3072, 163),
    *(
        replace(sc21(96, 12288, 96, 8, 12, n, 1536, t), id=f"sc21-t2-175b-{n}", source=SC21_T2, micro_batch=(1,))
        for n, t in ((384, 153), (768, 149), (1536, 141))
    ),
    *(
        replace(sc21(105, 20480, 128, 8, 35, n, 2240, t), id=f"sc21-t2-530b-{n}", source=SC21_T2, micro_batch=(1,))
        for n, t in ((560, 171), (1120, 167), (2240, 159))
    ),
    replace(
        sc21(96, 12288, 96, 8, 16, 1024, 1536, 138),
        id="sc21-readme-175b-1024",
        source=SC21_README,
        v=(1,),
        micro_batch=(1,),
    ),
    *(
        megascale_t2("megatron", n, b, mfu)
        for n, b, mfu in (
            (256, 768, 53.0),
            (512, 768, 49.9),
            (768, 768, 46.7),
            (1024, 768, 44.7),
            (3072, 6144, 48.7),
            (6144, 6144, 47.8),
            (8192, 6144, 43.3),
            (12288, 6144, 41.2),
        )
    ),
    *(
        megascale_t2("megascale", n, b, mfu)
        for n, b, mfu in (
            (256, 768, 65.3),
            (512, 768, 63.5),
            (768, 768, 61.3),
            (1024, 768, 59.0),
            (3072, 6144, 59.1),
            (6144, 6144, 57.3),
            (8192, 6144, 54.9),
            (12288, 6144, 55.2),
        )
    ),
    *(megascale_f9("megatron", n, mfu) for n, mfu in ((2240, 49.2), (4480, 48.8), (11200, 48.2))),
    *(megascale_f9("megascale", n, mfu) for n, mfu in ((2240, 54.3), (4480, 54.1), (11200, 54.3))),
    titan(8, 5762),
    titan(128, 5605),
]
# Held out: never used to fit a constant (the fit, "Validation" in docs/planning.md, saw only ROWS).
# Same team, hardware (Selene A100s) and 530B shape as sc21-t2-530b-2240, whose layout (tp8 pp35)
# and batch (2240) are taken for these rows since the abstract states neither; the system is the
# SC'21 code (megatron-2021) with the recomputation the source states.
HELD_OUT_POINTS = 6.0  # the bound tests/plan/test_published.py holds these rows to
HELD_OUT: list[Row] = [
    replace(
        sc21(105, 20480, 128, 8, 35, 2240, 2240, 0),
        id=f"korthikanti-530b-2240-{rc}",
        source=KORTHIKANTI,
        published=mfu,
        convention="full",
        reported=f"MFU {mfu}%",
        micro_batch=(1,),
        recompute=(rc,),
    )
    for rc, mfu in (("selective", 54.2), ("full", 42.1))
]
# Table 3: 175B, 256 GPUs, batch 256 (x3 with LAMB), optimisations switched on in turn
MS_T3_ROWS = (
    ("baseline", 47.7),
    ("parallel block", 52.3),
    ("sliding window", 53.3),
    ("TP overlap", 55.5),
    ("PP overlap", 58.0),
    ("DP overlap", 59.5),
    ("efficient operators", 61.2),
    ("data pipeline, GC, stragglers", 62.3),
    ("LAMB, batch x3", 65.3),
)


# The constants fitted to published rows (docs/planning.md, "Validation"): one per cluster or per
# family of systems (megatron-2021 inherits megatron's constants, torchtitan reuses megascale's).
FITTED = (
    "slow_host_fraction",
    "megatron.chunk_overhead_us",
    "megatron.host_overhead_s",
    "megatron.jitter_cv",
    "megascale.chunk_overhead_us",
)


def family(system: str) -> str:
    return "megatron" if system.startswith("megatron") else "megascale"


def with_constants(
    system: SystemSpec, cluster: ClusterSpec, constants: dict[str, float]
) -> tuple[SystemSpec, ClusterSpec]:
    """`system` and `cluster` with the `FITTED` constants in `constants` replaced."""
    if "slow_host_fraction" in constants:
        cluster = replace(cluster, slow_hosts=replace(cluster.slow_hosts, fraction=constants["slow_host_fraction"]))
    impl, fam = system.features.impl, family(system.name)
    for key, value in constants.items():
        if key.startswith(f"{fam}."):
            name = key.split(".", 1)[1]
            impl = (
                replace(impl, jitter=replace(impl.jitter, cv=value))
                if name == "jitter_cv"
                else replace(impl, **{name: value})
            )
    return replace(system, features=replace(system.features, impl=impl)), cluster


def predict(row: Row, constants: dict[str, float] | None = None) -> StepEstimate:
    system, cluster = load_system(row.system), load_cluster(row.cluster)
    if constants:
        system, cluster = with_constants(system, cluster, constants)
    work = system.apply(Workload(row.model, row.batch, dtype="bf16"))
    space = SearchSpace(
        zero_stages=(system.zero if row.zero is None else row.zero,),
        micro_batches=row.micro_batch,
        tps=(row.tp,),
        pps=(row.pp,),
        virtuals=row.v,
        recompute=row.recompute,
        schedules=("1f1b",),  # the published runs' schedule (interleaved when v > 1)
    )
    found = search(work, row.gpus, cluster, system.features, space)
    if not found:
        raise SystemExit(f"{row.id}: no layout fits under the stated constraints")
    return found[0]


def published_percent(row: Row, est: StepEstimate) -> float:
    if "tps" in row.extra:  # torchtitan reports tokens/s per GPU: MFU in its own convention
        per_token = est.flops_per_step["full"] / est.tokens_per_step
        return 100 * row.extra["tps"] * per_token / (est.peak_flops_total / row.gpus)
    return row.published


def evaluate_rows(only: str | None, rows: list[Row] = ROWS, constants: dict[str, float] | None = None) -> list[dict]:
    out = []
    for row in rows:
        if only and not row.id.startswith(only):
            continue
        est = predict(row, constants)
        published = published_percent(row, est)
        predicted = 100 * est.mfu_in(row.convention)
        out.append(
            {
                "id": row.id,
                "source": row.source,
                "system": row.system,
                "cluster": row.cluster,
                "gpus": row.gpus,
                "batch": row.batch,
                "reported": row.reported,
                "convention": row.convention,
                "published_pct": round(float(published), 2),
                "predicted_pct": round(float(predicted), 2),
                "error_points": round(float(predicted - published), 2),
                "layout": est.layout.label(),
                "step_time_s": float(est.step_time),
                "terms_s": est.breakdown(),
                "note": row.note,
            }
        )
    return out


def evaluate_ablation() -> list[dict]:
    """Table 3 on one layout: its last row is Table 2's 256-GPU MegaScale figure (65.3%), so the
    layout is the one predicted for that row (v=6 stated; micro-batch searched)."""
    cluster = load_cluster("a100-8x200g")
    base, target = load_system("megatron"), load_system("megascale")
    layout_work = Workload(MS_175B, 768, dtype="bf16")
    layout = predict(next(r for r in ROWS if r.id == "ms-t2-megascale-256")).layout
    rows = ablate(layout_work, 256, cluster, base, target, lamb_scale=3, layout=layout)
    out = []
    for (name, published), row in zip(MS_T3_ROWS, rows, strict=True):
        predicted = 100 * row.cumulative.mfu_in("full")
        out.append(
            {
                "id": f"ms-t3-{name}",
                "source": MS_T3,
                "system": f"megatron -> {name}",
                "cluster": cluster.name,
                "gpus": 256,
                "batch": row.cumulative.micro_batches * 4,
                "reported": f"MFU {published}%",
                "convention": "full",
                "published_pct": published,
                "predicted_pct": round(predicted, 2),
                "error_points": round(float(predicted - published), 2),
                "layout": layout.label(),
                "step_time_s": row.cumulative.step_time,
                "terms_s": row.cumulative.breakdown(),
                "note": "",
            }
        )
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        "| row | system | GPUs | batch | layout (searched: v, mb, rc) | published | predicted | error (points) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        short = r["layout"].replace(" zero=", " z").replace(" rc=", " ")
        lines.append(
            f"| {r['id']} | {r['system']} | {r['gpus']} | {r['batch']} | {short} | "
            f"{r['published_pct']:.1f}% ({r['reported']}) | {r['predicted_pct']:.1f}% | "
            f"{r['error_points']:+.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="rows whose id starts with this")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_published.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    rows = evaluate_rows(args.only)
    if not args.only or args.only.startswith("ms-t3"):
        rows += evaluate_ablation()
    held_out = evaluate_rows(args.only, HELD_OUT)
    for r in held_out:
        print(
            f"held out: {r['id']:<30} {r['layout']:<44} published {r['published_pct']:5.1f}%  "
            f"predicted {r['predicted_pct']:5.1f}%  error {r['error_points']:+5.1f} "
            f"(bound +-{HELD_OUT_POINTS:g})"
        )
    for r in rows:
        flag = "" if abs(r["error_points"]) <= GOAL_POINTS else "  MISS"
        print(
            f"{r['id']:<28} {r['layout']:<44} published {r['published_pct']:5.1f}%  predicted "
            f"{r['predicted_pct']:5.1f}%  error {r['error_points']:+5.1f}{flag}"
        )
    errors = [abs(r["error_points"]) for r in rows]
    within = sum(e <= GOAL_POINTS for e in errors)
    print(
        f"{within}/{len(rows)} rows within +-{GOAL_POINTS:g} points; mean |error| "
        f"{statistics.mean(errors):.2f}, max {max(errors):.2f} ({time.perf_counter() - start:.1f} s)"
    )
    if args.markdown:
        print(markdown(rows))
    if not args.only:
        Path(args.out).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d", time.gmtime()),
                    "goal_points": GOAL_POINTS,
                    "within_goal": within,
                    "rows": rows,
                    "held_out_bound_points": HELD_OUT_POINTS,
                    "held_out": held_out,
                },
                indent=2,
            )
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
