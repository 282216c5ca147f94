"""Peak memory of a training step per pipeline schedule, measured on two gloo ranks with the
profiler's CPU memory accounting (allocation sizes are deterministic, so are the peaks).

Zero-bubble schedules hold a micro-batch's weight-gradient inputs (each GEMM's input and
output gradient) from its B to its W. In the paper ZB-H1 costs 1F1B's activation memory (p
micro-batches, 1F1B's first rank, on every rank). What the runtime adds on top must stay
small: it once held a whole chunk's weight gradients at once in every W (1.36x 1F1B's peak)
and each norm's inputs until W.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megascale.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
from megascale.data import TokenBatch
from megascale.model import GPT
from megascale.parallel import init_mesh
from megascale.parallel.pipeline import PipelineRunner, split_model
from megascale.parallel.pipeline.schedule import V_SHAPED
from megascale.testing.launch import run_local

pytestmark = pytest.mark.timeout(300)

SCHEDULES = {"1f1b": 1, "zb-h1": 1, "zbv": 2}  # schedule -> vpp
M = 4


def job(kind: str, v: int) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(vocab_size=64, seq_len=64, layers=8, hidden=128, heads=4, positions="learned"),
        parallel=ParallelConfig(pp=2, vpp=v, schedule=kind),
        train=TrainConfig(micro_batch=4, global_batch=4 * M, device="cpu"),
    )
    cfg.validate()
    return cfg


def peak_step_bytes(runner: PipelineRunner, batch: TokenBatch, tokens: int) -> int:
    """Peak bytes allocated during one step above its start (gradients included)."""
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.forward_backward(batch, tokens)
    runner.zero_grad()
    live = peak = 0
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]":
            live += event.nbytes()
            peak = max(peak, live)
    return peak


def _rank_main() -> dict[str, int]:
    torch.set_num_threads(1)
    mesh = init_mesh(ParallelConfig(pp=2), device="cpu")
    try:
        g = torch.Generator().manual_seed(1)
        shape = (M, 4, 64)
        batch = TokenBatch(torch.randint(0, 64, shape, generator=g), torch.randint(0, 64, shape, generator=g))
        peaks = {}
        for kind, v in SCHEDULES.items():
            cfg = job(kind, v)
            torch.manual_seed(0)
            chunks = split_model(GPT(cfg.model), 2, v, mesh.pp_rank, "auto", kind in V_SHAPED)
            runner = PipelineRunner(chunks, cfg, mesh)
            runner.forward_backward(batch, batch.labels.numel())  # learns the shapes
            runner.zero_grad()
            peaks[kind] = peak_step_bytes(runner, batch, batch.labels.numel())
        return peaks
    finally:
        mesh.destroy()


@pytest.mark.slow
def test_zero_bubble_peak_memory_stays_near_1f1b():
    """The peak over ranks of a zero-bubble step at most 1.15x 1F1B's (its first rank's).
    Measured here: ZB-H1 1.10x, ZB-V 1.12x; before W accumulated layer by layer and the norms
    reduced in B, 1.28x and 1.18x (both fail)."""
    ranks = run_local(_rank_main, 2, (), timeout_s=240)
    base = max(r["1f1b"] for r in ranks)
    for kind in ("zb-h1", "zbv"):
        worst = max(r[kind] for r in ranks)
        assert worst <= 1.15 * base, f"{kind}: peak {worst / 2**20:.1f} MiB vs 1F1B's {base / 2**20:.1f} MiB"
