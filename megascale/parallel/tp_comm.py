"""Tensor-parallel communication operators with their autograd rules.

Activations are batch-first `[batch, seq, ...]`. With sequence parallelism (SP) a rank holds
the sequence slice `[rank * s/tp, (rank+1) * s/tp)`; without it every tp rank holds the whole
sequence and Megatron's conjugate pair is used: `copy_to_tp` (identity forward, all-reduce
backward) in front of a column-parallel layer, `reduce_from_tp` (all-reduce forward, identity
backward) behind a row-parallel one. Every wait on a collective is a `comm` timer span, so the
communication that is *exposed* (not hidden behind compute) is what the timers report.

`vocab_combine` lets the chunked loss (`model/loss.py`) run on vocabulary-split weights without
ever gathering logits: per chunk, one all-gather of each token's local log-sum-exp and target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Function

from megascale.diagnostics.timers import get_timers

# Recent PyTorch names the tensor collectives *_single; older releases (pyproject accepts 2.6+)
# only have *_tensor. ZeRO uses these too.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class TPContext:
    """This rank's place in its tensor-parallel group and how the layers communicate.

    `group` is None when `size == 1`; every operator is then the identity (no collective)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    sequence_parallel: bool = True
    overlap: bool = True  # chunked collectives pipelined against the GEMM chunks
    chunks: int = 2

    def seq_range(self, seq_len: int) -> tuple[int, int]:
        """[start, end) of the full sequence that this rank holds under SP."""
        if seq_len % self.size:
            raise ValueError(
                f"sequence parallelism needs the sequence length {seq_len} to be divisible by tp={self.size}"
            )
        local = seq_len // self.size
        return self.rank * local, (self.rank + 1) * local


class Pending:
    """An in-flight collective; `wait()` is timed as exposed communication."""

    __slots__ = ("work", "name", "result")

    def __init__(self, work: dist.Work | None, name: str, result: torch.Tensor) -> None:
        self.work, self.name, self.result = work, name, result

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            with get_timers().span(self.name, kind="comm", op=self.name.split(".")[-1], group="tp"):
                self.work.wait()
            self.work = None
        return self.result


def start_all_gather(x: torch.Tensor, tp: TPContext) -> Pending:
    """Gather `x` from every tp rank into `[tp, *x.shape]` (rank-major), asynchronously."""
    if tp.group is None:
        return Pending(None, "tp.all_gather", x.unsqueeze(0))
    x = x.contiguous()
    out = x.new_empty((tp.size, *x.shape))
    work = all_gather_single(out.flatten(0, 1), x, group=tp.group, async_op=True)
    return Pending(work, "tp.all_gather", out)


def start_reduce_scatter(x: torch.Tensor, tp: TPContext) -> Pending:
    """Sum `[tp, *shape]` over the tp ranks and keep slice `rank` (`[*shape]`), asynchronously."""
    if tp.group is None:
        return Pending(None, "tp.reduce_scatter", x[0])
    x = x.contiguous()
    out = x.new_empty(x.shape[1:])
    work = reduce_scatter_single(out, x.flatten(0, 1), group=tp.group, async_op=True)
    return Pending(work, "tp.reduce_scatter", out)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over the tp `group` (no autograd), timed as communication."""
    if group is not None:
        Pending(dist.all_reduce(x, op=op, group=group, async_op=True), "tp.all_reduce", x).wait()
    return x


def gather_along(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """Concatenate the tp ranks' pieces along `dim` (no autograd)."""
    return start_all_gather(x, tp).wait().movedim(0, dim % x.dim()).flatten(dim % x.dim(), dim % x.dim() + 1)


def reduce_scatter_along(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """Sum over the tp ranks and keep this rank's slice of `dim` (no autograd)."""
    pieces = x.unflatten(dim, (tp.size, -1)).movedim(dim % x.dim(), 0)
    return start_reduce_scatter(pieces, tp).wait()


def split_along(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """This rank's slice of `dim` (no communication)."""
    size = x.shape[dim] // tp.size
    return x.narrow(dim, tp.rank * size, size)


class _CopyToTP(Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), ctx.tp.group), None


class _ReduceFromTP(Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        return all_reduce(x.contiguous().clone(), tp.group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ReduceScatterSeq(Function):
    """Sum partial activations over tp and keep this rank's sequence slice; backward gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return reduce_scatter_along(x, 1, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_along(grad, 1, ctx.tp), None


class _GatherSeq(Function):
    """All-gather along the sequence for a consumer that works on vocabulary slices (the chunked
    loss); the backward sums every rank's partial gradient and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return gather_along(x, 1, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_along(grad.contiguous(), 1, ctx.tp), None


class _GatherReplicated(Function):
    """Gather pieces along `dim` for a consumer that every rank runs identically (logits for
    inspection): the gradient of this rank's piece is its slice of the replicated gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
        ctx.dim, ctx.tp = dim, tp
        return gather_along(x, dim, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split_along(grad, ctx.dim, ctx.tp).contiguous(), None, None


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.group is None else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.group is None else _ReduceFromTP.apply(x, tp)


def reduce_scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.group is None else _ReduceScatterSeq.apply(x, tp)


def gather_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.group is None else _GatherSeq.apply(x, tp)


def gather_replicated(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    return x if tp.group is None else _GatherReplicated.apply(x, dim, tp)


def vocab_combine(tp: TPContext):
    """For `model.loss.chunked_cross_entropy` on vocabulary-split weights: each token's
    log-sum-exp and target logit over the whole vocabulary from every rank's slice, with one
    all-gather (logsumexp of the log-sum-exps; the target is on one rank, 0 on the others)."""

    def combine(lse: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = start_all_gather(torch.stack([lse, target]), tp).wait()  # [tp, 2, tokens]
        return torch.logsumexp(both[:, 0], 0), both[:, 1].sum(0)

    return combine
