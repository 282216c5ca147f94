"""The one place that turns a model into what this rank runs, and runs a step's micro-batches.

`build_runner` applies parallelism from outside the model, in a fixed order: tensor parallel
(layers replaced by sharded ones), pipeline split (keep this rank's chunks), ZeRO-2 over dp
(per chunk). The trainer only sees a `ModelRunner`: forward+backward of one optimizer step's
micro-batches, the tensors the optimizer steps on, and the hooks around the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megascale.config.schema import JobConfig
from megascale.data import TokenBatch
from megascale.diagnostics.timers import get_timers
from megascale.model.efficiency import (
    apply_compile,
    apply_recompute,
    fuse_parallel_input_gemm,
    set_attention_kernel,
)
from megascale.parallel.materialize import materialize
from megascale.parallel.tensor import apply_tensor_parallel
from megascale.parallel.zero import ZeroGradSync


class ModelRunner:
    """One pipeline stage holding one chunk: runs micro-batches one after another.

    Subclasses (the pipeline runner) override `forward_backward` and `eval_loss_sum`."""

    def __init__(self, chunks: list[nn.Module], cfg: JobConfig, mesh=None):
        self.chunks = chunks
        self.cfg = cfg
        self.mesh = mesh
        self.grad_sync = None  # set by ZeRO: reduce-scatter after backward, all-gather after step

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast around forwards when train.dtype = bf16 (backward follows it)."""
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(self._device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def module(self) -> nn.Module:
        return self.chunks[0]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters of this rank's chunks, named as in the single-process model."""
        for chunk in self.chunks:
            yield from chunk.named_parameters()

    def optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs the optimizer updates: parameters, or their ZeRO shards."""
        if self.grad_sync is not None:
            return self.grad_sync.optimizer_tensors()
        return list(self.named_parameters())

    def forward_backward(self, batch: TokenBatch, token_count: int) -> torch.Tensor:
        """Accumulate gradients of (sum of token losses / token_count) over the micro-batches;
        returns this rank's summed token loss (detached, float64, on the model's device: reading
        it on the host once per step, not once per micro-batch, keeps the GPU queue full)."""
        timers = get_timers()
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        model = self.module
        if self.grad_sync is not None:
            self.grad_sync.before_forward(0)
        for inputs, labels in zip(batch.inputs, batch.labels, strict=True):
            with timers.span("forward"), self.autocast():
                loss = model(inputs.to(self._device), labels.to(self._device))
            with timers.span("backward"):
                (loss / token_count).backward()
            total += loss.detach().double()
        if self.grad_sync is not None:
            self.grad_sync.after_backward(0)
        return total

    @torch.no_grad()
    def eval_loss_sum(self, batch: TokenBatch) -> torch.Tensor:
        if self.grad_sync is not None:
            self.grad_sync.before_forward(0)
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        for inputs, labels in zip(batch.inputs, batch.labels, strict=True):
            with self.autocast():
                loss = self.module(inputs.to(self._device), labels.to(self._device))
            total += loss.double()
        return total

    def finish_grads(self) -> None:
        """Gradients are complete and synchronised across dp when this returns."""
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def after_optimizer_step(self) -> None:
        """Start refreshing the parameters from the updated shards (ZeRO)."""
        if self.grad_sync is not None:
            self.grad_sync.after_step()

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)
        if self.grad_sync is not None:
            self.grad_sync.zero_grad()

    def close(self) -> None:
        """Wait for communication still in flight (the next step's parameter prefetch), so that
        destroying the process groups cannot abort a pending collective."""
        if self.grad_sync is not None:
            self.grad_sync.wait_params()

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)

    @property
    def _device(self) -> torch.device:
        return next(self.module.parameters()).device


def build_runner(model: nn.Module, cfg: JobConfig, mesh=None) -> ModelRunner:
    """Apply every parallelism the layout asks for, then the speed-only transformations of the
    blocks (they wrap whatever blocks the parallel code left), and return this rank's runner.

    `model` may be on the meta device: its parameters get their values (`train.seed`) after
    the layout is applied, on the mesh's device, only for the part this rank holds."""
    runner = _parallel_runner(model, cfg, mesh)
    for chunk in runner.chunks:
        set_attention_kernel(chunk, cfg.train.attention)
        blocks = getattr(chunk, "blocks", None)
        if blocks is None:
            continue
        if cfg.train.fuse_input_gemm and (mesh is None or mesh.tp_size == 1):
            fuse_parallel_input_gemm(blocks)  # tensor parallel fuses its own
        apply_recompute(blocks, cfg.train.recompute)
        if cfg.train.compile:
            apply_compile(blocks)
    return runner


def _parallel_runner(model: nn.Module, cfg: JobConfig, mesh) -> ModelRunner:
    distributed = mesh is not None and mesh.world_size > 1
    if distributed and mesh.tp_size > 1:
        apply_tensor_parallel(model, cfg, mesh)
    if distributed and mesh.pp_size > 1:
        from megascale.parallel.pipeline import PipelineRunner, split_model  # imports engine

        chunks = split_model(model, mesh.pp_size, cfg.parallel.vpp, mesh.pp_rank)
        runner: ModelRunner = PipelineRunner(chunks, cfg, mesh)
    else:
        runner = ModelRunner([model], cfg, mesh)
    device = mesh.device if mesh is not None else torch.device("cpu")
    materialize(runner.chunks, cfg.model, cfg.train.seed, device)  # only what this rank kept
    if distributed and (mesh.dp_size > 1 or mesh.tp_size > 1):
        # ZeRO-2 per chunk; with dp = 1 it only sums sequence-parallel gradients over tp
        runner.grad_sync = ZeroGradSync(runner.chunks, cfg, mesh)
    return runner


def reduce_sum(value: torch.Tensor, *groups) -> torch.Tensor:
    """Sum a small CPU/GPU tensor over each group in turn (groups may be None)."""
    for group in groups:
        if group is not None:
            dist.all_reduce(value, group=group)
    return value
