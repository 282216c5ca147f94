"""Calibrate the planner's cost model on this CPU: predicted vs measured step time.

The planner predicts a step from hardware figures. Here the figures are measured on this machine
(fp32 GEMM FLOP/s, memory bandwidth, fused-attention throughput at the model's shape, the cost
of one small kernel, gloo bandwidth and latency between two processes), turned into a one-node
"cluster", and the model's prediction for the default config is compared with:

  * the project's GPT (megascale.model) timed in this process: forward + backward over the
    micro-batches + gradient clipping + optimizer step, single process;
  * `megascale train` runs of the layouts dp x tp x pp = 1x1x1, 2x1x1, 1x2x1, 1x1x2 (median step
    time from metrics.jsonl). A layout the trainer cannot run yet is skipped with its error.

Machine figures are measured right before and after each run (the machine is shared and noisy),
and the GEMM rate also during it (between in-process steps; by a sampling thread beside
`megascale train`); both errors are reported. Then `megascale plan --calibrate` (plan/calibrate.py)
fits the efficiency constants to the `megascale train` runs' timer databases and reports the fit
error per term (compute, collectives, pipeline, optimizer, host, step), before and after the fit.
Writes bench/results/plan_calibration.json.

    OMP_NUM_THREADS=1 python bench/plan_calibration.py [--steps 4] [--layouts 1x1x1,2x1x1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megascale.config import load_config
from megascale.config.schema import JobConfig
from megascale.model import GPT
from megascale.model.attention import causal_attention
from megascale.model.flops import mean_attention_span
from megascale.optim import build_optimizer, clip_grad_norm_
from megascale.parallel.store import free_port
from megascale.plan import efficiency as eff
from megascale.plan.calibrate import calibrate, format_calibration
from megascale.plan.cluster import ClusterSpec, GPUSpec, NetworkSpec, NodeSpec
from megascale.plan.cost import estimate
from megascale.plan.layout import Features, Layout, Workload

ROOT = Path(__file__).resolve().parents[1]
PROBE_SIZE = 1024


def _median_rate(work: float, fn, seconds: float) -> float:
    """Median of work/elapsed over repeated calls for `seconds`: on a shared machine the median
    reflects the share of a core a long training step gets; the best would overstate it."""
    fn()  # warm-up
    rates = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 3:
        start = time.perf_counter()
        fn()
        rates.append(work / (time.perf_counter() - start))
    return statistics.median(rates)


def measure_gemm_flops(seconds: float = 1.0) -> float:
    a, b = torch.randn(PROBE_SIZE, PROBE_SIZE), torch.randn(PROBE_SIZE, PROBE_SIZE)
    return _median_rate(2 * PROBE_SIZE**3, lambda: torch.mm(a, b), seconds)


def measure_memory_bandwidth(mib: int = 64, seconds: float = 0.5) -> float:
    """Bytes/s of an out-of-cache add (two reads, one write)."""
    n = mib * 2**20 // 4
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return _median_rate(3 * n * 4, lambda: torch.add(a, b, out=c), seconds)


def measure_kernel_overhead(repeats: int = 2000) -> float:
    """Seconds per tiny op with autograd on: what every small kernel costs on top of its work."""
    x = torch.randn(16, requires_grad=True)
    start = time.perf_counter()
    for _ in range(repeats):
        x = x * 1.0001
    return (time.perf_counter() - start) / repeats


def measure_attention_flops(cfg: JobConfig, seconds: float = 1.0) -> float:
    """Model FLOP/s of the model's attention kernel, forward + backward (3.5x forward FLOPs)."""
    m, b = cfg.model, cfg.train.micro_batch
    q, k, v = (torch.randn(b, m.heads, m.seq_len, m.head_dim, requires_grad=True) for _ in range(3))
    fwd_flops = 2 * 2 * mean_attention_span(m.seq_len, m.window) * m.hidden * m.seq_len * b
    return _median_rate(
        (1 + eff.ATTN_BWD_FLOPS_RATIO) * fwd_flops,
        lambda: causal_attention(q, k, v, m.window).sum().backward(),
        seconds,
    )


class GemmSampler:
    """Times one probe GEMM every `interval` seconds on a thread while a run goes on elsewhere:
    the CPU share this machine gives a process during that run (about 3% of one core)."""

    def __init__(self, interval: float = 2.0):
        self.interval, self.rates = interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        a, b = torch.randn(PROBE_SIZE, PROBE_SIZE), torch.randn(PROBE_SIZE, PROBE_SIZE)
        while not self._stop.wait(self.interval):
            start = time.perf_counter()
            torch.mm(a, b)
            self.rates.append(2 * PROBE_SIZE**3 / (time.perf_counter() - start))

    def __enter__(self) -> GemmSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure_machine(cfg: JobConfig) -> dict[str, float]:
    return {
        "gemm": measure_gemm_flops(),
        "mem_bw": measure_memory_bandwidth(),
        "attn": measure_attention_flops(cfg),
        "overhead": measure_kernel_overhead(),
    }


def _gloo_worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for nbytes in (4096, 16 * 2**20):
        t = torch.ones(nbytes // 4)
        dist.all_reduce(t)
        times = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        results[nbytes] = min(times)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure_gloo() -> tuple[float, float]:
    """(bus bandwidth bytes/s, per-step latency s) of a 2-process gloo all-reduce on loopback."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    big, small = 16 * 2**20, 4096
    # ring all-reduce over n=2: 2*(n-1)/n * S over the bus, 2*(n-1) latency steps
    latency = res[small] / 2
    bandwidth = big / max(res[big] - 2 * latency, 1e-9)
    return bandwidth, latency


def cpu_cluster(
    gemm: float, mem_bw: float, attn: float, overhead: float, gloo_bw: float, gloo_lat: float, cfg: JobConfig
) -> ClusterSpec:
    """This machine as the planner sees it: one node whose 'GPUs' are cores."""
    size_factor = eff.gemm_efficiency(
        GPUSpec("probe", {"fp32": 1.0}, 1, 1, 1.0, 1.0), PROBE_SIZE, PROBE_SIZE, PROBE_SIZE
    )
    peak = gemm / size_factor  # the curve then returns the probe's rate at the probe's size
    m = cfg.model
    span = mean_attention_span(m.seq_len, m.window)
    unit = GPUSpec("cpu", {"fp32": peak}, 1, mem_bw, 1.0, 1.0)
    attn_eff = attn / (peak * eff.attention_efficiency(unit, span, m.head_dim))
    gpu = GPUSpec(
        name="this-cpu",
        peak_flops={"fp32": peak},
        memory_bytes=psutil.virtual_memory().total,
        hbm_bytes_per_s=mem_bw,
        gemm_efficiency=1.0,
        attention_efficiency=attn_eff,
        reserved_bytes=0.0,
        kernel_overhead_s=overhead,
    )
    cores = max(2, os.cpu_count() or 2)
    node = NodeSpec(gpus=cores, nvlink_bytes_per_s=gloo_bw, nvlink_latency_s=gloo_lat, nics=1, nic_bytes_per_s=gloo_bw)
    return ClusterSpec(
        "this-cpu",
        gpu,
        node,
        NetworkSpec(nodes_per_tor=1, tors_per_pod=1),
        notes="measured by bench/plan_calibration.py",
    )


def measure_in_process(cfg: JobConfig, steps: int) -> list[tuple[float, float]]:
    """(seconds, GEMM FLOP/s probed right before and after) per optimizer step of the GPT on
    one process: forward + backward per micro-batch, gradient clipping, optimizer step."""
    torch.manual_seed(0)
    m, t = cfg.model, cfg.train
    model = GPT(m)
    opt = build_optimizer(model.named_parameters(), cfg.optim)
    micro = t.global_batch // t.micro_batch
    tokens = torch.randint(0, m.vocab_size, (micro, t.micro_batch, m.seq_len + 1))
    out = []
    for _ in range(steps + 1):
        probe = measure_gemm_flops(0.3)
        start = time.perf_counter()
        for i in range(micro):
            loss = model(tokens[i, :, :-1], tokens[i, :, 1:]) / (t.global_batch * m.seq_len)
            loss.backward()
        clip_grad_norm_(list(model.parameters()), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        out.append((elapsed, (probe + measure_gemm_flops(0.3)) / 2))
    return out[1:]  # the first step pays for allocations


def measure_train(config: str, layout: Layout, steps: int, run_dir: Path) -> tuple[float | None, str]:
    """Median step time of `megascale train` with this layout (run kept in `run_dir` for the
    calibration), or None and why."""
    cmd = [
        sys.executable,
        "-m",
        "megascale.cli",
        "train",
        "--config",
        config,
        f"--train.steps={steps + 1}",
        "--train.eval_every=0",
        "--checkpoint.every=0",
        "--train.tensorboard=false",
        f"--train.run_dir={run_dir}",
        *layout.overrides(),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, "timed out after 900 s"
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln] or lines or ["-"]
        return None, f"exit {proc.returncode}: {errors[-1][:300]}"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_time"] for r in rows[1:]]  # drop the warm-up step
    return (statistics.median(times), "ok") if times else (None, "no steps recorded")


def parse_layout(text: str, micro_batch: int) -> Layout:
    dp, tp, pp = (int(x) for x in text.lower().split("x"))
    return Layout(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--layouts", default="1x1x1,2x1x1,1x2x1,1x1x2", help="dp x tp x pp")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_calibration.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    work = replace(Workload.from_job(cfg), dtype="fp32")
    mb = cfg.train.micro_batch
    gloo = measure_gloo()
    print(f"gloo all-reduce (2 processes): {gloo[0] / 1e9:.2f} GB/s bus, {gloo[1] * 1e6:.0f} us per ring step")

    runs = [("GPT in-process", "1x1x1")] + [("megascale train", t) for t in args.layouts.split(",")]
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="plan-calibration-"))
    run_dirs: list[str] = []
    first_cluster: ClusterSpec | None = None
    for kind, text in runs:
        layout = parse_layout(text, mb)
        before = measure_machine(cfg)  # machine figures on both sides of the run: it is shared
        per_step: list[tuple[float, float]] = []
        if kind == "GPT in-process":
            per_step = measure_in_process(cfg, args.steps)
            measured, why = statistics.median(t for t, _ in per_step), "ok"
        else:
            run_dir = scratch / text
            with GemmSampler() as sampler:
                measured, why = measure_train(args.config, layout, args.steps, run_dir)
            if measured is not None and sampler.rates:  # one step's worth of GEMM share
                per_step = [(measured, statistics.median(sampler.rates))]
            if measured is not None:
                run_dirs.append(str(run_dir))
        after = measure_machine(cfg)
        figures = {k: (before[k] + after[k]) / 2 for k in before}
        cluster = cpu_cluster(**figures, gloo_bw=gloo[0], gloo_lat=gloo[1], cfg=cfg)
        first_cluster = first_cluster or cluster
        pred = estimate(work, layout, cluster, Features.from_job(cfg))
        err = None if measured is None else (pred.step_time - measured) / measured
        # the same prediction with the GEMM rate probed during the run (per step in-process,
        # a thread sampling alongside `megascale train`): contention varies within a run
        step_errors = [(pred.step_time * figures["gemm"] / g - t) / t for t, g in per_step]
        note = "" if measured is not None else f"SKIPPED: the trainer could not run it ({why})"
        rows.append(
            {
                "run": f"{kind} {text}",
                "layout": layout.label(),
                "predicted_s": pred.step_time,
                "measured_s": measured,
                "error": err,
                "note": note,
                "predicted_breakdown_s": pred.breakdown(),
                "error_with_in_run_probe": step_errors,
                "machine_before": before,
                "machine_after": after,
                "gloo_bytes_per_s": gloo[0],
                "gloo_latency_s": gloo[1],
            }
        )
        shown = "-" if measured is None else f"{measured:.3f} s"
        extra = "" if err is None else f"  error {err:+.1%}"
        if step_errors:
            extra += f" (with in-run probe: {statistics.median(step_errors):+.1%})"
        print(
            f"{kind} {text:<8} predicted {pred.step_time:.3f} s  measured {shown}{extra}  "
            f"(GEMM {before['gemm'] / 1e9:.1f}->{after['gemm'] / 1e9:.1f} GFLOP/s) {note}"
        )

    fit = None
    if run_dirs and first_cluster is not None:  # one set of constants for all trainer runs
        fitted = calibrate(run_dirs, first_cluster)
        print(format_calibration(fitted))
        fit = fitted.as_dict()
    shutil.rmtree(scratch, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "config": args.config,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "torch": torch.__version__,
                "load_average": os.getloadavg(),
                "rows": rows,
                "calibration": fit,
            },
            indent=2,
        )
    )
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    probed = [abs(statistics.median(r["error_with_in_run_probe"])) for r in rows if r["error_with_in_run_probe"]]
    if errors:
        print(
            f"mean |error| {statistics.mean(errors):.1%} over {len(errors)} runs with machine "
            f"figures measured before/after; {statistics.mean(probed):.1%} with the GEMM rate "
            "probed during each run"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
