"""Mixture-of-experts MLP: a router sends each token to `top_k` of `experts` MLPs.

Routing: softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3) scores in fp32; the top-k experts
by score (plus a per-expert bias under DeepSeek-V3's auxiliary-loss-free balancing, which only
chooses: the gates stay the scores), gates optionally renormalised. Dropless by default; with a
capacity factor each expert takes at most `ceil(factor * seq * k / experts)` tokens of a
sequence (the first ones), the rest pass through the residual only.

Every statistic that shapes the result is taken per sequence (capacity, the balancing loss),
never per micro-batch or per rank, so any data-parallel layout, pipeline split or micro-batch
count computes exactly what one process does. The balancing loss (Switch/GShard form, per
sequence: `E * sum_i f_i * P_i`, weighted by the sequence's tokens) and the router z-loss (a
token sum) are token sums like the model's loss; they reach the gradients through the layer's
output (`_AttachAux`), because under pipeline parallelism the head that computes the loss is
on another stage. `aux_scale` (set by the runner: 1 / global token count) scales them as the
loss is scaled.

The layer computes its local experts grouped: token copies sorted by expert, one GEMM pair per
expert over its contiguous rows. No parallel code lives here: `dispatcher` is the identity on
one process, and expert parallelism (megascale.parallel.expert) replaces it with one that
sends each expert's rows to the rank holding it and brings the results back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from megascale.config.schema import ModelConfig

# (rows grouped by local expert, rows per local expert) -> outputs in the same order
ExpertsFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


class Dispatcher(Protocol):
    """Runs `experts` on the rows `x` (sorted by global expert; `counts[e]` rows each)."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: ExpertsFn) -> torch.Tensor: ...


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, experts: ExpertsFn) -> torch.Tensor:
    """One process: every expert is local."""
    return experts(x, counts.tolist())


class _AttachAux(Function):
    """Identity on `out`; in backward gives the scalar `aux` the gradient `scale`, so the
    auxiliary losses join the objective wherever the loss itself is computed."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """Router, routed experts (`experts["i"]`), an optional shared expert (optionally gated)."""

    def __init__(self, cfg: ModelConfig, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        m = cfg.moe
        self.num_experts, self.top_k, self.kind, self.normalize = m.experts, m.top_k, m.router, m.normalize
        self.aux_coef, self.z_coef, self.capacity_factor = m.aux_loss_coef, m.z_loss_coef, m.capacity_factor
        self.bias_rate = m.bias_update_rate
        self.router = nn.Linear(cfg.hidden, m.experts, bias=False)
        # a dict keyed by the expert's index: expert parallelism keeps only its experts, names unchanged
        self.experts = nn.ModuleDict({str(i): make_mlp(cfg.expert_ffn) for i in range(m.experts)})
        self.shared = make_mlp(m.shared_ffn_hidden) if m.shared_ffn_hidden else None
        # Qwen2-MoE: each token's shared-expert output scaled by sigmoid(w . x)
        self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False) if m.shared_gate else None
        # routing bias (not trained by gradients: moved by `balance_step`)
        self.expert_bias = nn.Parameter(torch.zeros(m.experts), requires_grad=False) if m.bias_balancing else None
        self.dispatcher: Dispatcher = local_dispatch
        self.aux_scale = 1.0
        self.load: torch.Tensor | None = None  # [experts] assignments chosen since the last balance_step
        self.dropped: torch.Tensor | None = None  # assignments dropped by the capacity since then
        # per-sequence expert counts of this rank's tokens -> of the whole sequences (sequence
        # parallelism sums them over tp; one process: the identity)
        self.sequence_sum: Callable[[torch.Tensor], torch.Tensor] = _identity

    # ------------------------------------------------------------------ routing
    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 logits [T, E] -> (expert indices [T, k], gates [T, k], routing probabilities [T, E])."""
        scores = logits.softmax(-1) if self.kind == "softmax" else logits.sigmoid()
        choose = scores if self.expert_bias is None else scores + self.expert_bias.float()
        index = choose.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, index)
        if self.normalize or self.kind == "sigmoid":
            gates = gates / gates.sum(-1, keepdim=True)
        probs = scores if self.kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        return index, gates, probs

    def _aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, index: torch.Tensor, batch: int) -> torch.Tensor:
        """Token-summed balancing loss (per sequence) plus router z-loss."""
        aux = logits.new_zeros(())
        if self.aux_coef > 0:
            counts = self.sequence_sum(F.one_hot(index.view(batch, -1), self.num_experts).sum(1).float())  # [b, E]
            fraction = counts / counts.sum(-1, keepdim=True)  # of the sequence's seq * k assignments
            # this rank's tokens' share of sum_t p_ti (the shares add up over a split sequence)
            share = probs.view(batch, -1, probs.shape[-1]).sum(1)
            aux = aux + self.aux_coef * self.num_experts * (fraction * share).sum()
        if self.z_coef > 0:
            aux = aux + self.z_coef * logits.logsumexp(-1).square().sum()
        return aux

    def _capacity_keep(self, index: torch.Tensor, batch: int) -> torch.Tensor | None:
        """[T * k] bool: assignments within their expert's per-sequence capacity (None: dropless)."""
        if self.capacity_factor <= 0:
            return None
        seq = index.shape[0] // batch
        capacity = math.ceil(self.capacity_factor * seq * self.top_k / self.num_experts)
        one_hot = F.one_hot(index.view(batch, -1), self.num_experts)  # [b, s*k, E], token order
        position = (one_hot.cumsum(1) * one_hot).sum(-1)  # 1-based place in its expert's queue
        return (position <= capacity).view(-1)

    # ------------------------------------------------------------------ experts
    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Grouped computation of the local experts: `counts[j]` consecutive rows for the j-th
        local expert (in index order). Empty groups run too, so every expert has a gradient."""
        outs = [expert(rows) for expert, rows in zip(self.experts.values(), x.split(counts), strict=True)]
        return torch.cat(outs) if outs else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, hidden = x.shape[0], x.shape[-1]
        tokens = x.reshape(-1, hidden)
        logits = self.router(tokens).float()
        index, gates, probs = self.route(logits)
        flat, weight = index.reshape(-1), gates.reshape(-1)
        token = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)
        keep = self._capacity_keep(index, batch)
        if self.training:
            self._record(flat, keep)
        if keep is not None:
            flat, weight, token = flat[keep], weight[keep], token[keep]
        order = flat.argsort(stable=True)
        token, weight = token[order], weight[order]
        counts = torch.bincount(flat, minlength=self.num_experts)
        y = self.dispatcher(tokens[token], counts, self.run_experts)
        out = torch.zeros_like(tokens).index_add(0, token, y * weight.unsqueeze(-1).to(y.dtype))
        if self.shared is not None:
            shared = self.shared(tokens)
            if self.shared_gate is not None:
                shared = shared * self.shared_gate(tokens).sigmoid()
            out = out + shared
        out = out.view_as(x)
        if torch.is_grad_enabled() and (self.aux_coef > 0 or self.z_coef > 0):
            out = _AttachAux.apply(out, self._aux_loss(logits, probs, index, batch), self.aux_scale)
        return out

    @torch.no_grad()
    def _record(self, flat: torch.Tensor, keep: torch.Tensor | None) -> None:
        load = torch.bincount(flat, minlength=self.num_experts).double()
        dropped = (~keep).sum().double() if keep is not None else load.new_zeros(())
        self.load = load if self.load is None else self.load + load
        self.dropped = dropped if self.dropped is None else self.dropped + dropped


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_aux_scale(modules: list[nn.Module], scale: float) -> None:
    """The factor the loss is scaled by before backward (1 / global token count)."""
    for module in modules:
        for layer in moe_layers(module):
            layer.aux_scale = scale


def is_expert_parameter(name: str) -> bool:
    """A routed expert's parameter (`...mlp.experts.<i>.`): held by one expert-parallel rank."""
    return ".experts." in name


@torch.no_grad()
def balance_step(layers: list[MoE], reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float | list[float]]:
    """End of a step: the step's expert loads summed over every rank routing tokens (`reduce`),
    the bias of bias-balanced layers moved towards the mean load (DeepSeek-V3: +rate for an
    underloaded expert, -rate for an overloaded one), the counters reset. Returns the metrics:
    the worst layer's max/mean load and the share of assignments dropped by the capacity."""
    layers = [layer for layer in layers if layer.load is not None]
    if not layers:
        return {}
    stats = reduce(torch.stack([torch.cat([layer.load, layer.dropped.view(1)]) for layer in layers]))
    imbalance, dropped, assigned = 0.0, 0.0, 0.0
    for layer, row in zip(layers, stats, strict=True):
        load = row[:-1]
        mean = load.mean()
        if layer.expert_bias is not None:
            layer.expert_bias.add_(torch.sign(mean - load).to(layer.expert_bias.dtype), alpha=layer.bias_rate)
        imbalance = max(imbalance, float(load.max() / mean.clamp(min=1e-9)))
        dropped, assigned = dropped + float(row[-1]), assigned + float(load.sum())
        layer.load, layer.dropped = None, None
    return {
        "moe_imbalance": imbalance,
        "moe_dropped": dropped / max(assigned, 1.0),
        "moe_load": [float(v) for v in stats[0, :-1]],
    }
