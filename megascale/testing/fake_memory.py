"""One rank's memory at any layout, measured on the real model code without allocating it.

Why: the planner's memory model (`plan/memory.py`) is arithmetic; nothing checked it against
what `megascale train` really builds at a layout that does not fit this machine. Here the rank
is built as the trainer builds it -- `GPT` on the meta device, bf16 parameters, `build_runner`
(tensor parallel, pipeline split, materialization, ZeRO-2 buffers), `build_optimizer` -- under
torch's `FakeTensorMode`, with the mesh's real groups made on torch's `fake` process group (one
process plays rank `rank` of the whole world; collectives do nothing). Every tensor has its
shape, dtype and storage but no memory, so a 13B model at tp8 pp4 dp64 is measured in seconds.
(torchtitan estimates memory the same way, in fake mode.) Activations are the bytes autograd
saves for backward over one micro-batch of the rank's first chunk (saved-tensor hooks, storages
counted once, parameters excluded).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from megascale.config.schema import JobConfig, ParallelConfig
from megascale.layout.grid import RankGrid
from megascale.layout.launch import LaunchEnv
from megascale.model import GPT
from megascale.optim import build_optimizer
from megascale.parallel.engine import build_runner
from megascale.parallel.mesh import ParallelMesh, create_groups
from megascale.parallel.store import StartupStats


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds, by the planner's categories (`MemoryEstimate`)."""

    params: int  # the model's parameters (bf16 or fp32), this rank's tp slice of its stage
    grads: int  # ZeRO's fp32 gradient shards
    optimizer: int  # fp32 master shards + the optimizer's state
    buffers: int  # parameters' autograd gradients + the most ZeRO's buffers take at once
    activations: int  # saved for backward by one micro-batch through the first chunk

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "buffers": self.buffers,
            "activations": self.activations,
        }


def _bytes(tensors, seen: set[int]) -> int:
    """Bytes of the storages behind `tensors` not already in `seen` (views counted once)."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _mesh(parallel: ParallelConfig, rank: int) -> ParallelMesh:
    grid = RankGrid.of(parallel)
    if dist.is_initialized():
        raise RuntimeError(
            "fake-mode measurement needs a process without a default process group "
            "(it creates torch's fake one); call it before init_process_group"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=grid.world_size)
    timeout = timedelta(seconds=parallel.collective_timeout_s)
    groups, _ = create_groups(grid, rank, timeout)
    return ParallelMesh(
        grid,
        rank,
        torch.device("cpu"),
        "fake",
        groups,
        StartupStats(),
        timeout,
        None,
        LaunchEnv(rank=rank, world_size=grid.world_size),
    )


def measure_rank(cfg: JobConfig, rank: int = 0) -> RankMemory:
    """Build rank `rank` of the job `cfg` as the trainer does, in fake mode; count its bytes."""
    mesh = _mesh(cfg.parallel, rank)
    try:
        with torch.device("meta"):  # no memory yet; outside fake mode (it cannot swap meta tensors)
            model = GPT(cfg.model)
        if cfg.train.param_dtype == "bf16":  # as the trainer does
            model.to(torch.bfloat16)
        with FakeTensorMode(allow_non_fake_inputs=True):
            runner = build_runner(model, cfg, mesh)
            seen: set[int] = set()
            params = _bytes((p for c in runner.chunks for p in c.parameters()), seen)
            syncs = getattr(runner.grad_sync, "parts", (runner.grad_sync,))  # ExpertGradSync: two
            masters = _bytes((b.shard for z in syncs for chunk in z._chunks for b in chunk.buckets), seen)
            held = [z.memory_bytes() for z in syncs]  # its gradients and buffers exist during a step only
            grads, buffers = (sum(h[key] for h in held) for key in ("grads", "buffers"))
            buffers += params  # autograd's .grad of every parameter, in its dtype, until its bucket's launch
            named = runner.optimizer_tensors()
            optimizer = build_optimizer(named, cfg.optim)
            for _, shard in named:
                shard.grad = torch.zeros_like(shard)
            optimizer.step()  # the state is created on the first step
            state = _bytes(
                (
                    v
                    for s in optimizer.state.values()
                    for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                ),
                seen,
            )
            activations = _saved_bytes(runner, cfg)
    finally:
        dist.destroy_process_group()
    return RankMemory(params=params, grads=grads, optimizer=masters + state, buffers=buffers, activations=activations)


def _saved_bytes(runner, cfg: JobConfig) -> int:
    chunk = runner.chunks[0]
    param_keys = {p.untyped_storage()._cdata for p in chunk.parameters()}
    saved: set[int] = set(param_keys)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += _bytes((t,), saved)
        return t

    b, s = cfg.train.micro_batch, cfg.model.seq_len
    tokens = torch.zeros(b, s, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), runner.autocast():
        chunk(tokens)
    return total


def compare_with_plan(cfg: JobConfig, rank: int = 0) -> dict[str, dict[str, float]]:
    """Measured vs `job_memory_estimate` per category, in bytes, and measured / planned.

    The planner's activations are for the micro-batches the first stage holds at its peak; the
    measurement is one micro-batch, so the planner's figure is divided by its own in-flight
    count. Buffers are compared on the gradient part (`gradient_buffer_bytes`): the planner's
    other buffers (tp and pp transfers, the last stage's logits) are not measured here."""
    from megascale.plan.layout import Layout, Workload
    from megascale.plan.memory import (
        gradient_buffer_bytes,
        in_flight_micro_batches,
        job_memory_estimate,
        largest_parameter,
        stage_params_per_gpu,
    )

    measured = measure_rank(cfg, rank).as_dict()
    plan = job_memory_estimate(cfg, "cuda").as_dict()
    layout, work = Layout.from_job(cfg), Workload.from_job(cfg)
    plan["activations"] /= in_flight_micro_batches(layout, cfg.micro_batches)
    param_bytes = 2 if cfg.train.param_dtype == "bf16" else 4
    psi = stage_params_per_gpu(work, layout)
    largest = largest_parameter(work, layout.tp)
    plan["buffers"] = gradient_buffer_bytes(psi, layout.dp, param_bytes, cfg.parallel.dp_bucket_mb, largest)
    return {
        key: {
            "measured": float(measured[key]),
            "planned": float(plan[key]),
            "ratio": measured[key] / plan[key] if plan[key] else float("inf"),
        }
        for key in measured
    }
