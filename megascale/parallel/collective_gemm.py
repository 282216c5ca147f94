"""Collective GEMMs: the sequence-parallel all-gather and reduce-scatter fused into the GEMMs.

MegaScale's tensor-parallel overlap: instead of "all-gather the whole input, then one GEMM"
(column-parallel layer) and "one GEMM, then reduce-scatter the whole output" (row-parallel
layer), the sequence is cut into `chunks` pieces and the GEMM of one piece runs while the
collective of another is in flight:

    all-gather + GEMM   (forward of QKV/fc, backward of proj):  AG(0) AG(1) ... issued at once,
                        GEMM(c) as soon as AG(c) lands, so AG(c+1) hides behind GEMM(c);
    GEMM + reduce-scatter (forward of proj, backward of QKV/fc): GEMM(c), RS(c) issued, then
                        GEMM(c+1) (and the weight-gradient GEMM of chunk c in backward) runs
                        while RS(c) is in flight.

A chunk `c` is positions `[r0, r1)` of every rank's sequence slice, so it is one collective
call over contiguous buffers (`[tp, batch, r1-r0, ...]`, rank-major). Only the first gather and
the last reduce-scatter of a layer are exposed. With `tp.overlap` off there is one chunk and
every collective is waited for as soon as it is issued: the plain, unfused baseline.

Both operations are autograd Functions whose backward is the other one (the backward of
all-gather+GEMM is GEMM+reduce-scatter of the gradient, and vice versa); weight gradients are
computed from the gathered input kept from the forward pass, chunk by chunk, between the
collectives of the input gradient; under a split backward (`weight_grad.deferring`, the
zero-bubble schedules) they are deferred to the W action instead, from the same pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function

from megascale.parallel import weight_grad
from megascale.parallel.tp_comm import Pending, TPContext, start_all_gather, start_reduce_scatter
from megascale.parallel.weight_grad import Target, accumulate, compute_dtype


def chunk_ranges(length: int, chunks: int) -> list[tuple[int, int]]:
    """`[start, end)` ranges cutting `length` positions into at most `chunks` near-equal parts."""
    n = max(1, min(chunks, length))
    bounds = [length * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _plan(tp: TPContext, local_len: int) -> list[tuple[int, int]]:
    return chunk_ranges(local_len, tp.chunks if tp.overlap else 1)


def _issue(pending: Pending, tp: TPContext) -> Pending:
    """Without overlap a collective is waited for at once: nothing runs while it is in flight."""
    if not tp.overlap:
        pending.wait()
    return pending


class _AllGatherMatmul(Function):
    """y = all_gather_seq(x) @ W^T + b;  x: [b, s/tp, k] -> y: [b, s, n_local]."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPContext, target: Target | None
    ) -> torch.Tensor:
        ctx.target = target
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        x, weight, bias = compute_dtype(x, weight, bias)
        batch, local, _ = x.shape
        ranges = _plan(tp, local)
        pending = [_issue(start_all_gather(x[:, r0:r1], tp), tp) for r0, r1 in ranges]
        out = x.new_empty(batch, tp.size, local, weight.shape[0])
        gathered = []
        with torch.autocast(x.device.type, enabled=False):
            for (r0, r1), p in zip(ranges, pending, strict=True):
                chunk = p.wait()  # [tp, b, r1-r0, k]: AG(c+1..) in flight while this GEMM runs
                out[:, :, r0:r1] = F.linear(chunk, weight, bias).transpose(0, 1)
                gathered.append(chunk)
        ctx.tp, ctx.ranges = tp, ranges
        ctx.save_for_backward(weight, *gathered)
        return out.view(batch, tp.size * local, -1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weight, *gathered = ctx.saved_tensors
        tp: TPContext = ctx.tp
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        batch, seq, n = grad_out.shape
        local = seq // tp.size
        grad = grad_out.to(weight.dtype).reshape(batch, tp.size, local, n)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        pending, grad_w, grad_b, grad_x = [], None, None, None
        with torch.autocast(grad.device.type, enabled=False):
            for (r0, r1), chunk in zip(ctx.ranges, gathered, strict=True):
                g = grad[:, :, r0:r1].transpose(0, 1)  # [tp, b, c, n], the order of `chunk`
                if need_x:
                    pending.append(_issue(start_reduce_scatter(g.matmul(weight), tp), tp))
                if need_w:  # runs while the reduce-scatter of this chunk is in flight
                    grad_w = accumulate(grad_w, g, chunk)
            grad_w = None if grad_w is None else grad_w.to(w_dtype)
            if b_dtype is not None and need_b:
                grad_b = grad_out.sum((0, 1), dtype=torch.float32).to(b_dtype)
        if ctx.target is not None:  # split backward: the weight-gradient GEMMs wait for W
            chunks = [(grad[:, :, r0:r1].transpose(0, 1), c) for (r0, r1), c in zip(ctx.ranges, gathered, strict=True)]
            target = ctx.target
            weight_grad.defer(
                lambda: target.pairs(lambda: _sum_chunks(chunks), lambda: grad_out.sum((0, 1), dtype=torch.float32))
            )
        if need_x:
            grad_x = grad.new_empty(batch, local, weight.shape[1], dtype=x_dtype)
            for (r0, r1), p in zip(ctx.ranges, pending, strict=True):
                grad_x[:, r0:r1] = p.wait()
        return grad_x, grad_w, grad_b, None, None


class _MatmulReduceScatter(Function):
    """z = reduce_scatter_seq(x @ W^T);  x: [b, s, k_local] -> z: [b, s/tp, n]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tp: TPContext, target: Target | None) -> torch.Tensor:
        ctx.target = target
        ctx.dtypes = (x.dtype, weight.dtype)
        x, weight = compute_dtype(x, weight)
        batch, seq, k = x.shape
        start, end = tp.seq_range(seq)
        local = end - start
        ranges = _plan(tp, local)
        parts = x.reshape(batch, tp.size, local, k)
        with torch.autocast(x.device.type, enabled=False):
            pending = [  # GEMM(c+1) runs while RS(c) is in flight
                _issue(start_reduce_scatter(F.linear(parts[:, :, r0:r1].transpose(0, 1), weight), tp), tp)
                for r0, r1 in ranges
            ]
        out = x.new_empty(batch, local, weight.shape[0])
        for (r0, r1), p in zip(ranges, pending, strict=True):
            out[:, r0:r1] = p.wait()
        ctx.tp, ctx.ranges = tp, ranges
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        tp: TPContext = ctx.tp
        x_dtype, w_dtype = ctx.dtypes
        batch, seq, k = x.shape
        local = seq // tp.size
        parts = x.reshape(batch, tp.size, local, k)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_out = grad_out.to(weight.dtype)
        pending = [_issue(start_all_gather(grad_out[:, r0:r1], tp), tp) for r0, r1 in ctx.ranges]
        grad_x = x.new_empty(batch, tp.size, local, k, dtype=x_dtype) if need_x else None
        grad_w, chunks = None, []
        with torch.autocast(x.device.type, enabled=False):
            for (r0, r1), p in zip(ctx.ranges, pending, strict=True):
                g = p.wait()  # [tp, b, c, n]; the gathers of later chunks land meanwhile
                if need_x:
                    grad_x[:, :, r0:r1] = g.matmul(weight).transpose(0, 1)
                if need_w:
                    grad_w = accumulate(grad_w, g, parts[:, :, r0:r1].transpose(0, 1))
                if ctx.target is not None:
                    chunks.append((g, parts[:, :, r0:r1].transpose(0, 1)))
        grad_w = None if grad_w is None else grad_w.to(w_dtype)
        if ctx.target is not None:  # split backward: the weight-gradient GEMMs wait for W
            target = ctx.target
            weight_grad.defer(lambda: target.pairs(lambda: _sum_chunks(chunks), None))
        return (grad_x.view(batch, seq, k) if need_x else None), grad_w, None, None


def _sum_chunks(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The weight gradient from the (output-gradient, input) pieces of every chunk."""
    grad_w = None
    with torch.autocast(chunks[0][0].device.type, enabled=False):
        for g, x in chunks:
            grad_w = accumulate(grad_w, g, x)
    return grad_w


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPContext) -> torch.Tensor:
    """Column-parallel GEMM on a sequence-parallel input: `[b, s/tp, k] -> [b, s, n/tp]`."""
    if weight_grad.active():
        target = Target.of(weight, bias)
        return _AllGatherMatmul.apply(x, weight.detach(), weight_grad.detached(bias), tp, target)
    return _AllGatherMatmul.apply(x, weight, bias, tp, None)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Row-parallel GEMM into the sequence-parallel layout: `[b, s, k/tp] -> [b, s/tp, n]`
    (the bias, replicated, is added by the caller after the reduction)."""
    if weight_grad.active():
        return _MatmulReduceScatter.apply(x, weight.detach(), tp, Target.of(weight, None))
    return _MatmulReduceScatter.apply(x, weight, tp, None)
