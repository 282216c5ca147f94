"""ZeRO-2 benchmark: exposed data-parallel communication with overlap on and off, and the
throughput of the 2x2x2 layout against one process.

1. dp=2 on gloo (two local ranks). Two copies of the same model are trained side by side in
   one run, one with `parallel.dp_overlap=true` (reduce-scatter buckets launched by gradient
   hooks during the last backward, all-gather of the next step's parameters launched right
   after the optimizer step) and one with it off (everything synchronous after backward and
   after the step); rounds of a few steps alternate between them. Per step: wall time and
   the *exposed* DP communication, i.e. the time spent inside the `dp.*` timer spans, which
   cover only the waits for collectives (the launches are asynchronous).
2. tokens/s of a (dp, tp, pp) = (2, 2, 2) layout on eight local ranks against one process on
   the same model and global batch. Eight ranks share this machine's cores, so this watches
   the overheads of the layout; it is not a speed-up figure.

    python bench/zero_overlap.py [--rounds 4] [--steps 4] [--hidden 256] [--layers 4]

Writes bench/results/zero_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from megascale.checkpoint.stateful import TrainState
from megascale.config.schema import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megascale.data import TokenBatch
from megascale.diagnostics.timers import Timers, set_timers
from megascale.model import GPT
from megascale.optim import build_optimizer
from megascale.parallel.engine import build_runner
from megascale.parallel.mesh import ParallelMesh, init_mesh
from megascale.parallel.timed_comm import timed_all_reduce
from megascale.testing.launch import run_local
from megascale.train.trainer import Trainer

RESULTS = Path(__file__).parent / "results" / "zero_overlap.json"


def job(
    args: argparse.Namespace,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    overlap: bool = True,
    hidden: int | None = None,
    seq_len: int | None = None,
    bucket_mb: float = 16.0,
) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(
            vocab_size=256, seq_len=seq_len or args.seq_len, layers=args.layers, hidden=hidden or args.hidden, heads=4
        ),
        optim=OptimConfig(name="lamb", warmup_steps=0),
        parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, dp_overlap=overlap, dp_bucket_mb=bucket_mb, backend="gloo"),
        train=TrainConfig(global_batch=args.global_batch, micro_batch=args.micro_batch, device="cpu", steps=10**6),
    )
    cfg.validate()
    return cfg


class BenchTrainer(Trainer):
    """`Trainer.train_step` on a model built here (no loaders, checkpoints or metrics)."""

    def __init__(self, cfg: JobConfig, mesh: ParallelMesh, timers: Timers) -> None:
        self.cfg, self.mesh, self.train_state, self.timers = cfg, mesh, TrainState(), timers  # step 0
        torch.manual_seed(cfg.train.seed)
        self.runner = build_runner(GPT(cfg.model), cfg, mesh)
        self.sum_over = partial(timed_all_reduce, mesh=mesh)  # as the Trainer: its step reads it
        self.optimizer = build_optimizer(self.runner.optimizer_tensors(), cfg.optim, self.sum_over)
        self.init_numerics()


def batches(cfg: JobConfig, dp_rank: int, count: int) -> list[TokenBatch]:
    g = torch.Generator().manual_seed(1 + dp_rank)
    shape = (cfg.micro_batches, cfg.train.micro_batch, cfg.model.seq_len)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.model.vocab_size, (*shape[:2], shape[2] + 1), generator=g)
        out.append(TokenBatch(tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()))
    return out


def _timers(mesh: ParallelMesh) -> Timers:
    timers = Timers(mesh.rank, mesh.coords._asdict(), None, None, enabled=True)
    set_timers(timers)
    return timers


# ---------------------------------------------------------------------------- part 1
def overlap_rank(args: argparse.Namespace) -> dict:
    """One of two dp ranks: alternate rounds of steps between the overlapped and the
    synchronous copy; the first step of every round is a warm-up and not counted."""
    mesh = init_mesh(ParallelConfig(dp=2, backend="gloo"), device="cpu")
    try:
        timers = _timers(mesh)
        trainers = {
            mode: BenchTrainer(job(args, dp=2, overlap=mode == "on", bucket_mb=args.bucket_mb), mesh, timers)
            for mode in ("on", "off")
        }
        data = batches(trainers["on"].cfg, mesh.dp_rank, args.steps)
        stats: dict[str, dict[str, list[float]]] = {m: {"step": [], "comm": []} for m in trainers}
        for _ in range(args.rounds):
            for mode, trainer in trainers.items():
                timers.end_step(0)
                for i, batch in enumerate(data):
                    trainer.train_step(batch)
                    trainer.step += 1
                    totals = timers.end_step(trainer.step)
                    if i:
                        stats[mode]["step"].append(totals["step"])
                        stats[mode]["comm"].append(totals["comm"])
        buckets = len(trainers["on"].runner.grad_sync._chunks[0].buckets)
        return {
            "stats": stats,
            "buckets": buckets,
            "params": sum(p.numel() for p in trainers["on"].runner.module.parameters()),
        }
    finally:
        mesh.destroy()


# ---------------------------------------------------------------------------- part 2
def throughput_rank(args: argparse.Namespace, layout: tuple[int, int, int]) -> float:
    """Median tokens/s of one layout (this rank's view; every rank runs the same steps)."""
    dp, tp, pp = layout
    cfg = job(args, dp=dp, tp=tp, pp=pp, hidden=args.small_hidden, seq_len=args.small_seq_len)
    mesh = init_mesh(cfg.parallel, device="cpu")
    try:
        trainer = BenchTrainer(cfg, mesh, _timers(mesh))
        times = []
        for i, batch in enumerate(batches(cfg, mesh.dp_rank, args.warmup + args.steps)):
            start = time.perf_counter()
            trainer.train_step(batch)
            trainer.step += 1
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        return cfg.train.global_batch * cfg.model.seq_len / statistics.median(times)
    finally:
        mesh.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="steps per round (first is warm-up)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=2.0,
        help="parallel.dp_bucket_mb in part 1 (2 MiB = 512Ki fp32 elements per rank)",
    )
    parser.add_argument("--small-hidden", type=int, default=128, help="part 2 model width")
    parser.add_argument("--small-seq-len", type=int, default=64, help="part 2 sequence length")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    ranks = run_local(overlap_rank, 2, args=(args,), timeout_s=1800)
    part1 = {}
    for mode in ("on", "off"):
        steps = [s for r in ranks for s in r["stats"][mode]["step"]]
        comm = [c for r in ranks for c in r["stats"][mode]["comm"]]
        part1[mode] = {
            "step_s_median": statistics.median(steps),
            "exposed_dp_comm_s_median": statistics.median(comm),
            "exposed_dp_comm_s_mean": statistics.fmean(comm),
            "samples": len(steps),
        }
    on, off = part1["on"], part1["off"]
    print(
        f"part 1: dp=2 gloo, {ranks[0]['params'] / 1e6:.2f}M parameters, "
        f"{ranks[0]['buckets']} buckets, {on['samples']} steps per mode (both ranks)"
    )
    for mode in ("on", "off"):
        r = part1[mode]
        print(
            f"  dp_overlap={mode:3s}: step {r['step_s_median'] * 1e3:7.1f} ms, exposed DP comm "
            f"{r['exposed_dp_comm_s_median'] * 1e3:6.1f} ms (median per step)"
        )
    exposed_ratio = on["exposed_dp_comm_s_median"] / max(off["exposed_dp_comm_s_median"], 1e-9)
    step_ratio = on["step_s_median"] / off["step_s_median"]
    print(f"  overlap/sync: exposed comm x{exposed_ratio:.2f}, step time x{step_ratio:.2f}")

    os.environ.pop("WORLD_SIZE", None)
    single = throughput_rank(args, (1, 1, 1))
    layered = run_local(throughput_rank, 8, args=(args, (2, 2, 2)), timeout_s=1800)
    layered_tps = statistics.median(layered)
    print(
        f"part 2: tokens/s one process {single:.0f}, (dp,tp,pp)=(2,2,2) on 8 ranks "
        f"{layered_tps:.0f}: x{layered_tps / single:.2f} ({os.cpu_count()} cores)"
    )

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "args": vars(args),
                "overlap": {
                    "params": ranks[0]["params"],
                    "buckets": ranks[0]["buckets"],
                    **part1,
                    "exposed_comm_ratio_on_over_off": exposed_ratio,
                    "step_time_ratio_on_over_off": step_ratio,
                },
                "layout_2x2x2": {
                    "tokens_per_s_single": single,
                    "tokens_per_s_2x2x2": layered_tps,
                    "ratio": layered_tps / single,
                },
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
