"""The one place that turns a model into what this rank runs.

`build_runner` applies parallelism from outside the model, in a fixed order: tensor parallel
(layers replaced by sharded ones), context parallel (attention and positions told their part of
the sequence), expert parallel (this rank's experts kept), pipeline split (keep this rank's
chunks), materialization of what this rank kept, ZeRO-2 over dp (per chunk; at dp = 1 over a
group of one: it holds the fp32 master weights in every layout), then the speed-only block
transformations. The trainer only sees the `ModelRunner` it returns (`parallel/runner.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from megascale.config.schema import JobConfig
from megascale.model.efficiency import (
    apply_compile,
    apply_recompute,
    fuse_parallel_gemms,
    set_attention_kernel,
    set_loss_chunk,
)
from megascale.model.init import SeededValues, ValueSource
from megascale.parallel.context import apply_context_parallel, uses_ring
from megascale.parallel.expert import ExpertGradSync, apply_expert_parallel, apply_sequence_sums
from megascale.parallel.materialize import materialize
from megascale.parallel.pipeline import PipelineRunner, split_model
from megascale.parallel.pipeline.schedule import V_SHAPED
from megascale.parallel.runner import ModelRunner
from megascale.parallel.tensor import apply_tensor_parallel
from megascale.parallel.zero import ZeroGradSync


def build_runner(model: nn.Module, cfg: JobConfig, mesh=None, values: ValueSource | None = None) -> ModelRunner:
    """Apply every parallelism the layout asks for, then the speed-only transformations of the
    blocks (they wrap whatever blocks the parallel code left), and return this rank's runner.

    `model` may be on the meta device: its parameters get their values after the layout is
    applied, on the mesh's device, only for the part this rank holds; from `values` (e.g. a
    pretrained model's tensors), by default the seeded initial values of `train.seed`."""
    runner = _parallel_runner(model, cfg, mesh, values or SeededValues(cfg.model, cfg.train.seed))
    for chunk in runner.chunks:
        set_attention_kernel(chunk, cfg.train.attention)
        set_loss_chunk(chunk, cfg.train.loss_chunk)
        blocks = getattr(chunk, "blocks", None)
        if blocks is None:
            continue
        if cfg.train.fuse_input_gemm:
            fuse_parallel_gemms(blocks)  # tensor parallelism turned them on already
        apply_recompute(blocks, cfg.train.recompute)
        if cfg.train.compile:
            apply_compile(blocks)
    return runner


def _parallel_runner(model: nn.Module, cfg: JobConfig, mesh, values: ValueSource) -> ModelRunner:
    distributed = mesh is not None and mesh.world_size > 1
    if distributed and mesh.tp_size > 1:
        apply_tensor_parallel(model, cfg.parallel, mesh)
    if distributed and mesh.cp_size > 1:
        ring = uses_ring(cfg.model.window, cfg.model.seq_len)
        apply_context_parallel(model, mesh.cp_group, mesh.cp_rank, mesh.cp_size, ring)
    if distributed:
        apply_sequence_sums(model, mesh, cfg.parallel.sequence_parallel)
    if distributed and mesh.ep_size > 1:
        # before materialization: other ranks' experts never exist here
        apply_expert_parallel(model, mesh, cfg.parallel.ep_overlap_chunks)
    if distributed and mesh.pp_size > 1:
        p = cfg.parallel
        chunks = split_model(model, mesh.pp_size, p.vpp, mesh.pp_rank, p.pp_split, p.schedule in V_SHAPED)
        runner: ModelRunner = PipelineRunner(chunks, cfg, mesh)
    else:
        runner = ModelRunner([model], cfg, mesh)
    device = mesh.device if mesh is not None else torch.device("cpu")
    materialize(runner.chunks, values, device)  # only what this rank kept
    # ZeRO-2 per chunk; at dp = 1 a group of one, still the home of the fp32 masters
    # (with expert parallelism: the experts' ZeRO over the ranks holding the same experts)
    runner.grad_sync = (
        ExpertGradSync(runner.chunks, cfg, mesh)
        if distributed and mesh.ep_size > 1
        else ZeroGradSync(runner.chunks, cfg, mesh)
    )
    return runner
