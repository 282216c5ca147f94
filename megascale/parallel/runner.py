"""What one rank runs each step: the micro-batches of its model chunks, and the hooks around
the optimizer step.

`ModelRunner` is one pipeline stage holding one chunk (the pipeline runtime subclasses it). The
trainer sees only this interface: forward+backward of one optimizer step's micro-batches, the
tensors the optimizer steps on (parameters, or their ZeRO shards), and the gradient and
parameter synchronisation around the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from megascale.config.schema import JobConfig
from megascale.data import TokenBatch
from megascale.diagnostics.timers import get_timers
from megascale.layout.shard import shard_spec
from megascale.model.moe import balance_step, moe_layers, set_aux_scale
from megascale.parallel.context import sum_grads_over
from megascale.parallel.expert import balance_reducer
from megascale.parallel.tensor import sync_sequence_parallel_grads


class ModelRunner:
    """One pipeline stage holding one chunk: runs micro-batches one after another.

    Subclasses (the pipeline runner) override `forward_backward` and `eval_loss_sum`."""

    def __init__(self, chunks: list[nn.Module], cfg: JobConfig, mesh=None):
        self.chunks = chunks
        self.cfg = cfg
        self.mesh = mesh
        self.grad_sync = None  # build_runner sets ZeRO (the fp32 masters, any dp): reduce-scatter, all-gather
        self._sp_partial: list[torch.Tensor] | None = None  # optimizer tensors with partial grads
        self.moe_stats: dict = {}  # the last step's expert load (finish_grads): metrics

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast around forwards when train.dtype = bf16 (backward follows it)."""
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(self._device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def module(self) -> nn.Module:
        return self.chunks[0]

    @property
    def holds_loss(self) -> bool:
        """This rank computes the loss: it holds the model's last chunk (the last pipeline
        stage, or under ZB-V's V-shaped placement the first)."""
        return bool(getattr(self.chunks[-1], "is_last", True))

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
        self.scale_aux_losses(token_count)
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

    def scale_aux_losses(self, token_count: int) -> None:
        """MoE auxiliary losses are scaled as the loss is: by 1 / the global token count."""
        set_aux_scale(self.chunks, 1.0 / token_count)

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
        """Gradients are complete when this returns: summed over dp (ZeRO), over cp (each cp
        rank saw a part of every sequence) and, for parameters used on a sequence slice, over tp."""
        if self.grad_sync is not None:
            self.grad_sync.finish()
        cp_group = None if self.mesh is None else self.mesh.cp_group
        if cp_group is not None:
            sum_grads_over(self.optimizer_tensors(), cp_group)
        layers = [layer for chunk in self.chunks for layer in moe_layers(chunk)]
        if layers:  # the step's expert loads over dp: the routing bias moves, the metrics read them
            self.moe_stats = balance_step(layers, balance_reducer(self.mesh, self.cfg.parallel.sequence_parallel))
        tp_group = None if self.mesh is None else self.mesh.tp_group
        if tp_group is not None:
            if self._sp_partial is None:
                self._sp_partial = [t for _, t in self.optimizer_tensors() if shard_spec(t).sp_partial]
            sync_sequence_parallel_grads(self._sp_partial, tp_group)

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
