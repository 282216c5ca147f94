"""Split backward for zero-bubble pipeline schedules: input gradients now (B), weight gradients
later (W), for the linears, norms and embeddings, with the model code unchanged.

Zero-bubble schedules (Qi et al., ICLR 2024) fill the pipeline's bubble with weight-gradient
work: a stage's input gradient is what the previous stage waits for, its weight gradient is
needed by nobody until the optimizer step. So while `deferring(work)` is active (the pipeline
runtime sets it around a chunk's forward and its B), every layer that owns a weight computes
only its input gradient in the backward and appends to `work` a closure that, later, turns
what it kept (the GEMM's input and output gradient) into its weight gradients; `run(work)` is
the W action.

How the layers do it: the weight goes into the autograd Function *detached*, and the original
tensor (a parameter, or what the model built from it: the fused block's concatenated weights,
a cast) rides along as a `Target`. Autograd therefore never reaches a parameter in B (no
gradient, no ZeRO hook fires); W hands the computed gradients to `torch.autograd.backward` on
the targets, which accumulates them through whatever the model did to the parameters and
fires ZeRO's post-accumulate-grad hooks then: its reduce-scatter follows a chunk's last W.

Covered: the model's `Linear` (and the fused GEMMs going through it), tensor-parallel column-
and row-parallel layers and the collective GEMMs (`collective_gemm.py`), LayerNorm/RMSNorm
(the normalisation stays in B, the affine part's weight gradient moves to W), and token
embeddings (their output is made a leaf that B fills; W scatters it into the table).
`split_backward(chunk)` swaps the model's layer classes for the subclasses below, which behave
exactly like the originals outside `deferring`. Not split: learned positions (an add) and the
head, whose gradients the chunked loss computes in its forward (`model/loss.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.autograd.graph import GradientEdge, get_gradient_edge

from megascale.model.gpt import Linear

# A W closure: returns (where autograd starts: tensors or gradient edges, their gradients)
WeightWork = Callable[[], tuple[list, list[torch.Tensor]]]

_work: list[WeightWork] | None = None  # set while a split forward/backward runs


@contextlib.contextmanager
def deferring(work: list[WeightWork]) -> Iterator[None]:
    """Forwards build split graphs and backwards append their weight-gradient work to `work`.
    A module global, not thread-local: CUDA backward runs on autograd's device thread."""
    global _work
    saved, _work = _work, work
    try:
        yield
    finally:
        _work = saved


def active() -> bool:
    return _work is not None and torch.is_grad_enabled()


def defer(closure: WeightWork) -> None:
    """Called from a split Function's backward."""
    if _work is None:
        raise RuntimeError(
            "a split-backward layer ran its backward outside weight_grad.deferring(); "
            "the pipeline runtime's B action sets it"
        )
    _work.append(closure)


def run(work: list[WeightWork]) -> None:
    """The W action: every deferred weight gradient of one (micro-batch, chunk), each layer's
    accumulated as soon as it is computed (ZeRO's hooks fire here). One layer at a time, as a
    plain backward does: computing them all before one autograd call held a whole chunk's
    weight gradients at once beside the accumulated ones (a parameter-sized transient; with
    ZB-H1 a third of rank 0's peak above 1F1B's)."""
    work.reverse()  # popped from the end: in the order the backward deferred them
    while work:
        targets, grads = work.pop()()
        if targets:
            torch.autograd.backward(targets, grads)
        del targets, grads


Root = torch.Tensor | GradientEdge  # where W's autograd call starts


@dataclass(frozen=True)
class Target:
    """Where the gradients a split Function defers go (None where absent or frozen); not a
    tensor, so autograd does not see them as the Function's inputs. A parameter is kept as
    itself; a tensor the model built from parameters (the fused block's concatenated weights,
    a cast) as its gradient edge, so that W does not keep its values alive from F to W."""

    weight: Root | None
    bias: Root | None = None
    dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None)

    @staticmethod
    def of(weight: torch.Tensor, bias: torch.Tensor | None) -> Target:
        w, b = (t if t is not None and t.requires_grad else None for t in (weight, bias))
        return Target(_root(w), _root(b), (None if w is None else w.dtype, None if b is None else b.dtype))

    def pairs(
        self, grad_w: Callable[[], torch.Tensor], grad_b: Callable[[], torch.Tensor] | None
    ) -> tuple[list[Root], list[torch.Tensor]]:
        out_t: list[Root] = []
        out_g: list[torch.Tensor] = []
        if self.weight is not None:
            out_t.append(self.weight)
            out_g.append(grad_w().to(self.dtypes[0]))
        if self.bias is not None:
            out_t.append(self.bias)
            out_g.append(grad_b().to(self.dtypes[1]))
        return out_t, out_g


def _root(t: torch.Tensor | None) -> Root | None:
    return t if t is None or t.grad_fn is None else get_gradient_edge(t)


def detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def compute_dtype(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Cast to the autocast dtype when autocast is on, as `F.linear` would: the split GEMMs and
    the collective GEMMs run with autocast off on tensors already in the compute dtype."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a^T b over the flattened leading dimensions (a weight-gradient GEMM), summed in
    fp32 whatever the compute dtype."""
    part = a.reshape(-1, a.shape[-1]).t() @ b.reshape(-1, b.shape[-1])
    return part.float() if acc is None else acc.add_(part)


def _row_sum(g: torch.Tensor) -> torch.Tensor:
    return g.reshape(-1, g.shape[-1]).sum(0, dtype=torch.float32)


class _SplitLinear(Function):
    """y = x W^T + b; backward gives dx, W later gives dW = g^T x and db = sum(g)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: Target) -> torch.Tensor:
        ctx.x_dtype = x.dtype
        x, weight, bias = compute_dtype(x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(x, weight, bias)
        ctx.target = target
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        g, target = grad_out.to(weight.dtype), ctx.target
        defer(lambda: target.pairs(lambda: accumulate(None, g, x), lambda: _row_sum(g)))
        grad_x = (g @ weight).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class _SplitAffine(Function):
    """y = xhat * w (+ b) of a norm; backward gives dxhat = g * w and reduces dw = sum(g xhat)
    and db = sum(g) at once, W later accumulates them.

    The reductions are elementwise work over the tokens, no GEMM: deferring them gains no
    bubble, and would keep `xhat` and `g` ([tokens, hidden] each, per norm) alive from B to W,
    a fifth of a layer's W-stash; reduced in B only two [hidden] vectors wait for W."""

    @staticmethod
    def forward(
        ctx, xhat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: Target
    ) -> torch.Tensor:
        ctx.target = target
        ctx.save_for_backward(xhat, weight)
        return xhat * weight if bias is None else torch.addcmul(bias, xhat, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xhat, weight = ctx.saved_tensors
        target = ctx.target
        grad_w = _row_sum(grad_out * xhat) if target.weight is not None else None
        grad_b = _row_sum(grad_out) if target.bias is not None else None
        defer(lambda: target.pairs(lambda: grad_w, lambda: grad_b))
        return grad_out * weight, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, split under `deferring`."""
    if not active():
        return F.linear(x, weight, bias)
    return _SplitLinear.apply(x, weight.detach(), detached(bias), Target.of(weight, bias))


def affine(xhat: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """A norm's elementwise affine on its normalised input, split under `deferring`."""
    if weight is None:
        return xhat if bias is None else xhat + bias
    return _SplitAffine.apply(xhat, weight.detach(), detached(bias), Target.of(weight, bias))


def embedding(indices: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding`, split under `deferring`: the output is a leaf whose gradient B fills and
    W scatters into the table."""
    if not active() or not weight.requires_grad:
        return F.embedding(indices, weight)
    out = F.embedding(indices, weight.detach()).requires_grad_()

    def closure() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if out.grad is not None:
            grad.index_add_(0, indices.reshape(-1), out.grad.reshape(-1, weight.shape[1]).float())
        return [weight], [grad.to(weight.dtype)]

    _work.append(closure)  # registered in the forward: B leaves its input in out.grad
    return out


# --------------------------------------------------------------------------- model layers
class SplitLinear(Linear):
    def project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, weight, bias)


class SplitLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not active():
            return super().forward(x)
        return affine(F.layer_norm(x, self.normalized_shape, None, None, self.eps), self.weight, self.bias)


class SplitRMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not active():
            return super().forward(x)
        return affine(F.rms_norm(x, self.normalized_shape, None, self.eps), self.weight, None)


class SplitEmbedding(nn.Embedding):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not active():
            return super().forward(tokens)
        return embedding(tokens, self.weight)


_SPLIT: dict[type, type] = {
    Linear: SplitLinear,
    nn.LayerNorm: SplitLayerNorm,
    nn.RMSNorm: SplitRMSNorm,
    nn.Embedding: SplitEmbedding,
}


def split_backward(module: nn.Module) -> None:
    """Give every layer of `module` that owns a weight the split backward, in place (class
    swap: parameters, hooks and shard specs stay). Tensor-parallel layers have it already."""
    for m in module.modules():
        kind = _SPLIT.get(type(m))
        if kind is SplitEmbedding and (
            m.padding_idx is not None or m.max_norm is not None or m.scale_grad_by_freq or m.sparse
        ):
            raise ValueError(
                "split backward supports plain embeddings only (no padding_idx, max_norm, scale_grad_by_freq or sparse)"
            )
        if kind is not None:
            m.__class__ = kind
