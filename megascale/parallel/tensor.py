"""Tensor parallelism with sequence parallelism, applied to a built GPT from outside.

`parallelize` rewrites the model by a table (`LAYER_PLAN`): in every block the QKV and MLP
up-projections become column-parallel layers and both output projections row-parallel ones,
holding this rank's slice of the same parameters (names unchanged). The block's forward stays
the model's own: these layers only put the communication around the GEMM it already runs.

Layout (Megatron TP + SP; activations `[batch, seq, hidden]`):
- residual stream, LayerNorms: sequence-sharded `[b, s/tp, h]` (SP) or replicated (no SP);
- column-parallel layers (rows of the weight = whole key/value groups of heads / MLP columns,
  SwiGLU's gate and up interleaved so a slice keeps them paired): their input is
  all-gathered along the sequence inside the GEMM (`collective_gemm`);
- row-parallel layers: reduce-scattered along the sequence inside the GEMM; the bias is added
  after the reduction;
- parallel block: its fused GEMMs (`Block.fuse_gemms`, always on under TP) gather the one
  norm output once and reduce-scatter both branches once (GPT-NeoX's variant, a norm per
  branch, gathers and reduce-scatters each branch);
- embedding and head split along the vocabulary when tp divides it: the chunked loss
  (`model/loss.py`) runs on this rank's rows of the head, its per-token log-sum-exp and target
  merged over tp (`tp_comm.vocab_combine`), so no rank holds whole logits, nor even its
  vocabulary slice of them for more than one chunk; otherwise replicated and, under SP, applied
  to the local sequence slice only.

With SP, replicated parameters used on a sequence slice (LayerNorms, row-parallel biases,
learned positions, a replicated embedding/head) get a partial gradient on each rank; their
`ShardSpec` says so (`sp_partial`) and `sync_sequence_parallel_grads` sums them over tp, on
whatever tensors the optimizer steps on (parameters, or their ZeRO shards).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megascale.config.schema import ParallelConfig, check_tensor_parallel
from megascale.diagnostics.timers import get_timers
from megascale.layout.shard import ShardSpec, set_shard_spec, shard_spec, tp_slice
from megascale.model.gpt import GPT, Embedding, Head, Linear
from megascale.model.loss import chunked_cross_entropy
from megascale.model.moe import MoE
from megascale.parallel import weight_grad
from megascale.parallel.collective_gemm import all_gather_matmul, matmul_reduce_scatter
from megascale.parallel.tp_comm import (
    TPContext,
    copy_to_tp,
    gather_replicated,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    split_along,
    vocab_combine,
)


class _ParallelLinear(Linear):
    """A `Linear` holding this rank's slice of an existing layer's parameters."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPContext) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the parameters exist already
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.tp = tp


class ColumnParallelLinear(_ParallelLinear):
    """Output features split over tp; the input is whole (all-gathered along the sequence under SP)."""

    def project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.tp.sequence_parallel:
            return all_gather_matmul(x, weight, bias, self.tp)
        return weight_grad.linear(copy_to_tp(x, self.tp), weight, bias)


class RowParallelLinear(_ParallelLinear):
    """Input features split over tp; the partial outputs are summed (reduce-scattered under SP)."""

    def project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.tp.sequence_parallel:
            out = matmul_reduce_scatter(x, weight, self.tp)
        else:
            out = reduce_from_tp(weight_grad.linear(x, weight, None), self.tp)
        return out if bias is None else out + bias


# Which block layers become which parallel layer (the dimension of the weight that is split).
LAYER_PLAN: dict[str, type[_ParallelLinear]] = {
    "attn.qkv": ColumnParallelLinear,
    "mlp.fc": ColumnParallelLinear,
    "attn.proj": RowParallelLinear,
    "mlp.proj": RowParallelLinear,
}


class TPEmbedding(nn.Module):
    """Token (+ learned position) embedding whose output is in the residual layout."""

    def __init__(self, embed: Embedding, tp: TPContext, vocab_parallel: bool) -> None:
        super().__init__()
        self.tokens, self.positions = embed.tokens, embed.positions
        self.tp, self.vocab_parallel = tp, vocab_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tp, seq = self.tp, tokens.shape[1]
        start, end = tp.seq_range(seq) if tp.sequence_parallel else (0, seq)
        if self.vocab_parallel:  # rows [rank*V/tp, (rank+1)*V/tp); other ranks add the rest
            weight = self.tokens.weight
            local = tokens - tp.rank * weight.shape[0]
            outside = (local < 0) | (local >= weight.shape[0])
            h = weight_grad.embedding(local.masked_fill(outside, 0), weight)
            h = h.masked_fill(outside.unsqueeze(-1), 0.0)
            h = reduce_scatter_seq(h, tp) if tp.sequence_parallel else reduce_from_tp(h, tp)
        else:
            h = self.tokens(tokens[:, start:end])
        if self.positions is not None:
            h = h + self.positions.weight[start:end]
        return h


class TPHead(nn.Module):
    """Final LayerNorm, output projection and the summed token loss, the same on every tp rank."""

    def __init__(self, head: Head, tp: TPContext, vocab_parallel: bool) -> None:
        super().__init__()
        self.norm, self.out, self.loss_chunk = head.norm, head.out, head.loss_chunk
        self.tp, self.vocab_parallel = tp, vocab_parallel

    def _whole_sequence(self, h: torch.Tensor) -> torch.Tensor:
        """The normed input of vocabulary-parallel rows: every token, the gradient summed over tp."""
        x = self.norm(h)
        return gather_seq(x, self.tp) if self.tp.sequence_parallel else copy_to_tp(x, self.tp)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Whole `[b, s, V]` logits on every rank (for inspection; training never forms them)."""
        if self.vocab_parallel:
            return gather_replicated(F.linear(self._whole_sequence(h), self.out.weight), -1, self.tp)
        z = self.out(self.norm(h))
        return gather_replicated(z, 1, self.tp) if self.tp.sequence_parallel else z

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.vocab_parallel:
            weight = self.out.weight
            return chunked_cross_entropy(
                self._whole_sequence(h).flatten(0, 1),
                weight,
                labels.flatten(),
                self.loss_chunk,
                self.tp.rank * weight.shape[0],
                vocab_combine(self.tp),
            )
        if self.tp.sequence_parallel:
            labels = split_along(labels, 1, self.tp)
        loss = chunked_cross_entropy(self.norm(h).flatten(0, 1), self.out.weight, labels.flatten(), self.loss_chunk)
        return reduce_from_tp(loss, self.tp) if self.tp.sequence_parallel else loss


class _Slicer:
    """Replaces parameters by their tp slices (once per tensor: tied weights stay tied)."""

    def __init__(self, tp: TPContext) -> None:
        self.tp = tp
        self.done: dict[int, nn.Parameter] = {}

    def slice(self, old: nn.Parameter | None, dim: int) -> nn.Parameter | None:
        if old is None:
            return None
        if id(old) not in self.done:
            spec = ShardSpec(tuple(old.shape), dim, self.tp.rank, self.tp.size).split_over(self.tp.group)
            new = nn.Parameter(tp_slice(old.detach(), spec).clone(), requires_grad=old.requires_grad)
            set_shard_spec(new, spec)
            self.done[id(old)] = new
        return self.done[id(old)]

    def split(self, module: nn.Module, name: str, dim: int) -> None:
        setattr(module, name, self.slice(getattr(module, name), dim))

    def partial(self, *params: nn.Parameter | None) -> None:
        """Under SP these replicated parameters see only this rank's tokens."""
        if not self.tp.sequence_parallel:
            return
        for p in params:
            if p is not None:
                set_shard_spec(p, shard_spec(p).with_sp_partial())

    def head_norms(self, attn: nn.Module) -> None:
        """Query/key head norms (Qwen 3): each tp rank normalises its own heads, so their weights'
        gradients are partial over tp with or without SP."""
        for norm in (attn.q_norm, attn.k_norm):
            for p in norm.parameters() if norm is not None else ():
                set_shard_spec(p, shard_spec(p).with_sp_partial())

    def swap(self, block: nn.Module, path: str, kind: type[_ParallelLinear]) -> None:
        """Replace the layer at `path` by its `kind` counterpart holding this rank's slice."""
        parent_name, name = path.split(".")
        parent = getattr(block, parent_name)
        layer = getattr(parent, name)
        if kind is ColumnParallelLinear:
            weight, bias = self.slice(layer.weight, 0), self.slice(layer.bias, 0)
        else:
            weight, bias = self.slice(layer.weight, 1), layer.bias  # bias added after the sum
            self.partial(bias)
        setattr(parent, name, kind(weight, bias, self.tp))


def parallelize(model: GPT, tp: TPContext) -> None:
    """Rewrite `model` in place for `tp` (any size, 1 included)."""
    if any(isinstance(m, (_ParallelLinear, TPEmbedding, TPHead)) for m in model.modules()):
        raise RuntimeError("the model is already tensor-parallel; apply_tensor_parallel once")
    slicer = _Slicer(tp)
    vocab_parallel = model.cfg.vocab_size % tp.size == 0
    for block in model.blocks:
        moe = isinstance(block.mlp, MoE)
        for path, kind in LAYER_PLAN.items():
            if not (moe and path.startswith("mlp.")):
                slicer.swap(block, path, kind)
        if moe:  # replicated over tp, on this rank's sequence slice under SP (see megascale.parallel.expert)
            slicer.partial(*block.mlp.parameters())
        for norm in (block.ln1, block.ln2):
            if norm is not None:
                slicer.partial(*norm.parameters())
        slicer.head_norms(block.attn)
        block.fuse_gemms = block.fusable  # parallel block: one gather, one reduce-scatter
    if vocab_parallel:
        slicer.split(model.embed.tokens, "weight", 0)
        slicer.split(model.head.out, "weight", 0)
    else:
        slicer.partial(model.embed.tokens.weight, model.head.out.weight)
    positions = model.embed.positions
    slicer.partial(None if positions is None else positions.weight, *model.head.norm.parameters())
    model.embed = TPEmbedding(model.embed, tp, vocab_parallel)
    model.head = TPHead(model.head, tp, vocab_parallel)


def apply_tensor_parallel(model: GPT, p: ParallelConfig, mesh) -> None:
    """Shard `model` over `mesh.tp_group` in place; nothing to do when tp is 1."""
    check_tensor_parallel(model.cfg, mesh.tp_size, p.sequence_parallel)
    if mesh.tp_size == 1:
        return
    tp = TPContext(mesh.tp_group, mesh.tp_rank, mesh.tp_size, p.sequence_parallel, p.tp_overlap, p.tp_overlap_chunks)
    parallelize(model, tp)


def sync_sequence_parallel_grads(tensors: Iterable[torch.Tensor], tp_group: dist.ProcessGroup | None) -> None:
    """Sum the partial gradients of sequence-parallel tensors over tp (one coalesced all-reduce).

    `tensors` are what the optimizer steps on: parameters, or their ZeRO shards (a tp-replicated
    parameter's shard covers the same range on every tp rank, so the sum is the same)."""
    if tp_group is None:
        return
    grads, seen = [], set()
    for t in tensors:
        if shard_spec(t).sp_partial and t.grad is not None and id(t) not in seen:
            seen.add(id(t))
            grads.append(t.grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with get_timers().span("tp.sp_grad_all_reduce", kind="comm", op="all_reduce", group="tp"):
        dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
