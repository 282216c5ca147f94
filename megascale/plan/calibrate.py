"""Fit the cost model's constants to measured runs: `megascale plan --calibrate RUN_DIR ...`.

Each run directory holds the job's `config.toml` and its per-rank timer files, gathered into the
timer database (`diagnostics/store.py`). Per term, the measured time is the per-rank median over
steps (after a warm-up step) of the matching timer kind, taken at the slowest rank (the cost
model predicts the slowest stage); the prediction is the cost model's for the run's layout on
`cluster`. One constant per term is fitted over all runs, in this order, each with the earlier
ones applied:

  optimizer   -> gpu.hbm_gbps (the optimizer step streams its shard through memory)
  compute     -> gpu.gemm_efficiency and gpu.attention_efficiency (one factor)
  collectives -> node.nvlink_gbps and network.efficiency (one factor)
  host        -> implementation.host_overhead_s (data wait and other per-step host time)
  jitter      -> the per-rank compute ratios of the runs themselves (stragglers.py)

The factor is the median over runs of measured / predicted. The fit error per term is the
relative error of each run before and after the fit: one constant cannot follow run-to-run
differences the model does not explain, which is what the error after the fit shows.
"""

from __future__ import annotations

import sqlite3
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from megascale.config import ConfigError, load_config
from megascale.diagnostics.store import Collector
from megascale.plan.cluster import ClusterSpec
from megascale.plan.cost import StepEstimate, estimate
from megascale.plan.layout import Features, Implementation, Layout, Workload
from megascale.plan.stragglers import Jitter, jitter_from_run

# measured timer kinds -> predicted step terms
TERM_MAP = {
    "optimizer": (("optimizer",), ("optimizer",)),
    "compute": (("compute",), ("compute", "launch_gaps", "interleave")),
    "collectives": (("comm",), ("tp_exposed", "dp_exposed", "other")),
    "pipeline": (("p2p",), ("bubble", "pp_exposed")),
    "host": (("data", "other"), ("host",)),
    "step": (("step_time",), None),
}


@dataclass
class TermFit:
    term: str
    measured_s: list[float]
    before_s: list[float]
    after_s: list[float] = field(default_factory=list)
    factor: float = 1.0  # measured / predicted, fitted over the runs (1.0: not fitted)
    constant: str = ""

    @staticmethod
    def _errors(predicted: list[float], measured: list[float]) -> list[float | None]:
        return [(p - m) / m if m > 0 else None for p, m in zip(predicted, measured, strict=True)]

    @property
    def error_before(self) -> list[float | None]:
        return self._errors(self.before_s, self.measured_s)

    @property
    def error_after(self) -> list[float | None]:
        return self._errors(self.after_s, self.measured_s)


@dataclass
class Calibration:
    runs: list[str]
    layouts: list[str]
    terms: list[TermFit]
    cluster: ClusterSpec
    implementation: Implementation

    def as_dict(self) -> dict:
        gpu, node, net = self.cluster.gpu, self.cluster.node, self.cluster.network
        return {
            "runs": self.runs,
            "layouts": self.layouts,
            "terms": [
                {
                    "term": t.term,
                    "measured_s": t.measured_s,
                    "predicted_before_s": t.before_s,
                    "predicted_after_s": t.after_s,
                    "factor": t.factor,
                    "constant": t.constant,
                    "error_before": t.error_before,
                    "error_after": t.error_after,
                }
                for t in self.terms
            ],
            "fitted": {
                "gpu.gemm_efficiency": gpu.gemm_efficiency,
                "gpu.attention_efficiency": gpu.attention_efficiency,
                "gpu.hbm_gbps": gpu.hbm_bytes_per_s / 1e9,
                "node.nvlink_gbps": node.nvlink_bytes_per_s / 1e9,
                "network.efficiency": net.efficiency,
                "implementation.host_overhead_s": self.implementation.host_overhead_s,
                "jitter": self.implementation.jitter.describe(),
            },
        }


@dataclass
class _Run:
    path: Path
    work: Workload
    layout: Layout
    features: Features
    measured: dict[str, float]


def _load_run(run_dir: str | Path, warmup_steps: int) -> _Run:
    path = Path(run_dir)
    if not (path / "config.toml").is_file():
        raise ConfigError(f"{path}: no config.toml; pass a `megascale train` run directory")
    cfg = load_config(path / "config.toml")
    collector = Collector(path)
    try:
        collector.poll()
        rows = collector.conn.execute(
            "SELECT step, rank, compute, comm, p2p, data, optimizer, other, step_time FROM rank_steps ORDER BY step"
        ).fetchall()
    except sqlite3.Error as exc:
        raise ConfigError(f"{path}: cannot read its timer database ({exc})") from exc
    finally:
        collector.close()
    steps = sorted({r["step"] for r in rows})
    if len(steps) <= warmup_steps:
        raise ConfigError(f"{path}: {len(steps)} timed step(s); need more than {warmup_steps}")
    kept = [r for r in rows if r["step"] in set(steps[warmup_steps:])]
    per_rank: dict[int, dict[str, list[float]]] = {}
    for r in kept:
        slot = per_rank.setdefault(r["rank"], {})
        for kind in ("compute", "comm", "p2p", "data", "optimizer", "other", "step_time"):
            slot.setdefault(kind, []).append(r[kind] or 0.0)
    medians = {rank: {k: statistics.median(v) for k, v in kinds.items()} for rank, kinds in per_rank.items()}
    measured = {}
    for term, (kinds, _) in TERM_MAP.items():
        values = [sum(m[k] for k in kinds) for m in medians.values()]
        measured[term] = statistics.median(values) if term == "step" else max(values)
    layout = Layout.from_job(cfg)
    return _Run(path, Workload.from_job(cfg), layout, Features.from_job(cfg), measured)


def _predicted(est: StepEstimate, term: str) -> float:
    names = TERM_MAP[term][1]
    return est.step_time if names is None else sum(est.terms[n] for n in names)


def _predict(runs: list[_Run], cluster: ClusterSpec, impl: Implementation) -> list[StepEstimate]:
    return [estimate(r.work, r.layout, cluster, replace(r.features, impl=impl)) for r in runs]


def calibrate(run_dirs: list[str], cluster: ClusterSpec, warmup_steps: int = 1) -> Calibration:
    runs = [_load_run(d, warmup_steps) for d in run_dirs]
    impl = Implementation()
    before = _predict(runs, cluster, impl)
    fits = {t: TermFit(t, [r.measured[t] for r in runs], [_predicted(e, t) for e in before]) for t in TERM_MAP}

    def factor(term: str, estimates: list[StepEstimate]) -> float:
        ratios = [
            r.measured[term] / _predicted(e, term)
            for r, e in zip(runs, estimates, strict=True)
            if r.measured[term] > 0 and _predicted(e, term) > 0
        ]
        return statistics.median(ratios) if ratios else 1.0

    gpu, node, net = cluster.gpu, cluster.node, cluster.network
    k = factor("optimizer", before)
    cluster = replace(cluster, gpu=replace(gpu, hbm_bytes_per_s=gpu.hbm_bytes_per_s / k))
    fits["optimizer"].factor = k
    fits[
        "optimizer"
    ].constant = f"gpu.hbm_gbps {gpu.hbm_bytes_per_s / 1e9:.2f} -> {cluster.gpu.hbm_bytes_per_s / 1e9:.2f}"
    k = factor("compute", _predict(runs, cluster, impl))
    g = cluster.gpu
    cluster = replace(
        cluster, gpu=replace(g, gemm_efficiency=g.gemm_efficiency / k, attention_efficiency=g.attention_efficiency / k)
    )
    fits["compute"].factor = k
    fits["compute"].constant = (
        f"gpu.gemm_efficiency {g.gemm_efficiency:.3f} -> "
        f"{cluster.gpu.gemm_efficiency:.3f}, attention_efficiency "
        f"{g.attention_efficiency:.3f} -> {cluster.gpu.attention_efficiency:.3f}"
    )
    k = factor("collectives", _predict(runs, cluster, impl))
    cluster = replace(
        cluster,
        node=replace(node, nvlink_bytes_per_s=node.nvlink_bytes_per_s / k),
        network=replace(net, efficiency=net.efficiency / k),
    )
    fits["collectives"].factor = k
    fits["collectives"].constant = (
        f"node.nvlink_gbps {node.nvlink_bytes_per_s / 1e9:.3f} -> "
        f"{cluster.node.nvlink_bytes_per_s / 1e9:.3f}, network."
        f"efficiency {net.efficiency:.3f} -> {cluster.network.efficiency:.3f}"
    )
    host = statistics.median(r.measured["host"] for r in runs)
    jitters: list[float] = []
    for r in runs:
        try:
            jitters.extend(jitter_from_run(r.path / "diagnostics" / "diagnostics.sqlite", warmup_steps).samples)
        except ConfigError:
            continue  # one rank per stage: nothing to compare with
    impl = Implementation(
        host_overhead_s=host,
        jitter=Jitter(samples=tuple(jitters), source=f"{len(runs)} run(s)") if jitters else Jitter(),
    )
    fits["host"].constant = f"implementation.host_overhead_s 0 -> {host:.4f}"
    fits["pipeline"].constant = "not fitted: the bubble follows from compute (a check of the schedule)"
    fits["step"].constant = "all of the above"
    after = _predict(runs, cluster, impl)
    for t, fit in fits.items():
        fit.after_s = [_predicted(e, t) for e in after]
    return Calibration(
        runs=[str(r.path) for r in runs],
        layouts=[r.layout.label() for r in runs],
        terms=list(fits.values()),
        cluster=cluster,
        implementation=impl,
    )


def format_calibration(cal: Calibration) -> str:
    def pct(x: float | None) -> str:
        return "    -" if x is None else f"{x:+6.1%}"

    lines = [f"calibration over {len(cal.runs)} run(s):"]
    lines += [
        f"  run {i}: {run}  ({layout})" for i, (run, layout) in enumerate(zip(cal.runs, cal.layouts, strict=True))
    ]
    lines.append(
        f"{'term':<12} {'run':>3} {'measured s':>11} {'predicted':>10} {'error':>7} {'fitted':>10} {'error':>7}"
    )
    for fit in cal.terms:
        for i, (m, b, a, eb, ea) in enumerate(
            zip(fit.measured_s, fit.before_s, fit.after_s, fit.error_before, fit.error_after, strict=True)
        ):
            lines.append(
                f"{fit.term if i == 0 else '':<12} {i:>3} {m:>11.4f} {b:>10.4f} {pct(eb):>7} {a:>10.4f} {pct(ea):>7}"
            )
        lines.append(f"{'':<12}     fit: x{fit.factor:.3f}  {fit.constant}")
    lines.append(f"jitter: {cal.implementation.jitter.describe()}")
    return "\n".join(lines)
