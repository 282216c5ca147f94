"""Tensor parallelism with sequence parallelism, applied to a built GPT from outside.

`apply_tensor_parallel` cuts every weight of the (identically seeded) full model into this
rank's slice and swaps the embedding, the blocks and the head for tensor-parallel ones that
keep the same sub-modules, so parameter names stay those of the single-process model.

Layout (Megatron TP + SP; activations `[batch, seq, hidden]`):
- residual stream, LayerNorms: sequence-sharded `[b, s/tp, h]` (SP) or replicated (no SP);
- QKV and MLP fc: column-parallel (rows of the weight = whole heads / MLP columns), their
  input all-gathered along the sequence inside the GEMM (`collective_gemm`);
- attention and MLP output projections: row-parallel, reduce-scattered along the sequence
  inside the GEMM; their biases are added after the reduction;
- parallel block: the one LayerNorm output is gathered once for one GEMM over the
  concatenated QKV+fc weight, and both projections are one GEMM over the concatenated input,
  so one reduce-scatter;
- embedding and head split along the vocabulary when tp divides it (the loss is computed
  from vocabulary-split logits, `tp_comm.vocab_parallel_cross_entropy`); otherwise replicated
  and, under SP, applied to the local sequence slice only.

With SP, replicated parameters used on a sequence slice (LayerNorms, row-parallel biases,
learned positions, a replicated embedding/head) get a partial gradient on each rank; they are
flagged `_sp_partial_grad` and `sync_sequence_parallel_grads` sums them over tp.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megascale.config.schema import ConfigError, JobConfig, ModelConfig, ParallelConfig
from megascale.diagnostics.timers import get_timers
from megascale.model.gpt import GPT, IGNORE_INDEX, Block, Embedding, Head
from megascale.optim.norms import mark_sharded
from megascale.parallel.collective_gemm import all_gather_matmul, matmul_reduce_scatter
from megascale.parallel.sharding import ShardSpec, set_shard_spec, tp_slice
from megascale.parallel.tp_comm import (
    TPContext,
    copy_to_tp,
    gather_replicated,
    reduce_from_tp,
    reduce_scatter_seq,
    split_along,
    vocab_parallel_cross_entropy,
)

SP_PARTIAL_ATTR = "_sp_partial_grad"


def check_tensor_parallel_layout(model: ModelConfig, parallel: ParallelConfig, tp_size: int) -> None:
    """Refuse a layout that cannot be split, naming the numbers, before any collective."""
    if parallel.tp != tp_size:
        raise ConfigError(
            f"parallel.tp={parallel.tp} but this rank's tensor-parallel group has {tp_size} "
            f"rank(s); build the mesh from the same parallel config"
        )
    if model.heads % tp_size:
        raise ConfigError(f"tensor parallelism tp={tp_size} must divide model.heads={model.heads}")
    if model.ffn % tp_size:
        raise ConfigError(f"tensor parallelism tp={tp_size} must divide the MLP width {model.ffn}")
    if parallel.sequence_parallel and model.seq_len % tp_size:
        raise ConfigError(
            f"sequence parallelism needs tp={tp_size} to divide model.seq_len={model.seq_len}"
        )


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
            h = F.embedding(local.masked_fill(outside, 0), weight)
            h = h.masked_fill(outside.unsqueeze(-1), 0.0)
            h = reduce_scatter_seq(h, tp) if tp.sequence_parallel else reduce_from_tp(h, tp)
        else:
            h = self.tokens(tokens[:, start:end])
        if self.positions is not None:
            h = h + self.positions.weight[start:end]
        return h


class TPBlock(nn.Module):
    """A serial or parallel transformer block on sliced weights (same sub-modules as `Block`)."""

    def __init__(self, block: Block, tp: TPContext) -> None:
        super().__init__()
        self.kind = block.kind
        self.ln1, self.ln2, self.attn, self.mlp = block.ln1, block.ln2, block.attn, block.mlp
        self.tp = tp

    def _column(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.tp.sequence_parallel:
            return all_gather_matmul(x, weight, bias, self.tp)
        return F.linear(copy_to_tp(x, self.tp), weight, bias)

    def _row(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.tp.sequence_parallel:
            out = matmul_reduce_scatter(x, weight, self.tp)
        else:
            out = reduce_from_tp(F.linear(x, weight), self.tp)
        return out if bias is None else out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn, mlp = self.attn, self.mlp
        if self.ln2 is None:
            return x + self._parallel_branches(self.ln1(x))
        qkv = self._column(self.ln1(x), attn.qkv.weight, attn.qkv.bias)
        x = x + self._row(attn.attend(qkv), attn.proj.weight, attn.proj.bias)
        hidden = mlp.activation(self._column(self.ln2(x), mlp.fc.weight, mlp.fc.bias))
        return x + self._row(hidden, mlp.proj.weight, mlp.proj.bias)

    def _parallel_branches(self, h: torch.Tensor) -> torch.Tensor:
        """Attn(h) + MLP(h) with one gather, one GEMM in, one GEMM out and one reduction."""
        attn, mlp = self.attn, self.mlp
        width = attn.qkv.weight.shape[0]
        weight_in = torch.cat([attn.qkv.weight, mlp.fc.weight])
        bias_in = None if attn.qkv.bias is None else torch.cat([attn.qkv.bias, mlp.fc.bias])
        both = self._column(h, weight_in, bias_in)
        heads = attn.attend(both[..., :width])
        hidden = mlp.activation(both[..., width:])
        weight_out = torch.cat([attn.proj.weight, mlp.proj.weight], dim=1)
        bias_out = None if attn.proj.bias is None else attn.proj.bias + mlp.proj.bias
        return self._row(torch.cat([heads, hidden], dim=-1), weight_out, bias_out)


class TPHead(nn.Module):
    """Final LayerNorm, output projection and the summed token loss, the same on every tp rank."""

    def __init__(self, head: Head, tp: TPContext, vocab_parallel: bool) -> None:
        super().__init__()
        self.norm, self.out = head.norm, head.out
        self.tp, self.vocab_parallel = tp, vocab_parallel

    def _local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel: `[b, s, V/tp]`; replicated: `[b, s/tp or s, V]`."""
        x = self.norm(h)
        if not self.vocab_parallel:
            return self.out(x)
        if self.tp.sequence_parallel:
            return all_gather_matmul(x, self.out.weight, None, self.tp)
        return F.linear(copy_to_tp(x, self.tp), self.out.weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Whole `[b, s, V]` logits on every rank (for inspection; training never gathers)."""
        z = self._local_logits(h)
        if self.vocab_parallel:
            return gather_replicated(z, -1, self.tp)
        return gather_replicated(z, 1, self.tp) if self.tp.sequence_parallel else z

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        z = self._local_logits(h).float()
        if self.vocab_parallel:
            return vocab_parallel_cross_entropy(z.flatten(0, 1), labels.flatten(), self.tp).sum()
        if self.tp.sequence_parallel:
            labels = split_along(labels, 1, self.tp)
        loss = F.cross_entropy(z.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        return reduce_from_tp(loss, self.tp) if self.tp.sequence_parallel else loss


class _Slicer:
    """Replaces parameters by their tp slices (once per tensor: tied weights stay tied)."""

    def __init__(self, tp: TPContext) -> None:
        self.tp = tp
        self.done: dict[int, nn.Parameter] = {}

    def split(self, module: nn.Module, name: str, dim: int) -> None:
        old = getattr(module, name)
        if old is None:
            return
        if id(old) not in self.done:
            spec = ShardSpec(tuple(old.shape), dim, self.tp.rank, self.tp.size)
            new = nn.Parameter(tp_slice(old.detach(), spec).clone(), requires_grad=old.requires_grad)
            set_shard_spec(new, spec)
            mark_sharded(new, self.tp.group)
            self.done[id(old)] = new
        setattr(module, name, self.done[id(old)])

    def partial(self, *modules: nn.Module | None) -> None:
        """Under SP these replicated parameters see only this rank's tokens."""
        if not self.tp.sequence_parallel:
            return
        for module in modules:
            if module is not None:
                for p in module.parameters(recurse=False):
                    setattr(p, SP_PARTIAL_ATTR, True)


def parallelize(model: GPT, tp: TPContext) -> None:
    """Rewrite `model` in place for `tp` (any size, 1 included)."""
    if any(isinstance(m, (TPBlock, TPEmbedding, TPHead)) for m in model.modules()):
        raise RuntimeError("the model is already tensor-parallel; apply_tensor_parallel once")
    slicer = _Slicer(tp)
    vocab_parallel = model.cfg.vocab_size % tp.size == 0
    for i, block in enumerate(model.blocks):
        for linear, dim in ((block.attn.qkv, 0), (block.mlp.fc, 0)):
            slicer.split(linear, "weight", dim)
            slicer.split(linear, "bias", 0)
        for linear in (block.attn.proj, block.mlp.proj):
            slicer.split(linear, "weight", 1)
            if tp.sequence_parallel and linear.bias is not None:
                setattr(linear.bias, SP_PARTIAL_ATTR, True)
        slicer.partial(block.ln1, block.ln2)
        model.blocks[i] = TPBlock(block, tp)
    if vocab_parallel:
        slicer.split(model.embed.tokens, "weight", 0)
        slicer.split(model.head.out, "weight", 0)
    else:
        slicer.partial(model.embed.tokens, model.head.out)
    slicer.partial(model.embed.positions, model.head.norm)
    model.embed = TPEmbedding(model.embed, tp, vocab_parallel)
    model.head = TPHead(model.head, tp, vocab_parallel)


def apply_tensor_parallel(model: GPT, cfg: JobConfig, mesh) -> None:
    """Shard `model` over `mesh.tp_group` in place; nothing to do when tp is 1."""
    check_tensor_parallel_layout(model.cfg, cfg.parallel, mesh.tp_size)
    if mesh.tp_size == 1:
        return
    p = cfg.parallel
    tp = TPContext(mesh.tp_group, mesh.tp_rank, mesh.tp_size, p.sequence_parallel,
                   p.tp_overlap, p.tp_overlap_chunks)
    parallelize(model, tp)


def sync_sequence_parallel_grads(params: Iterable[torch.Tensor], mesh) -> None:
    """Sum the partial gradients of SP-replicated parameters over tp (one coalesced all-reduce).

    Call after backward and before data-parallel gradient synchronisation."""
    group = mesh.tp_group if mesh is not None else None
    if group is None:
        return
    grads, seen = [], set()
    for p in params:
        if getattr(p, SP_PARTIAL_ATTR, False) and p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            grads.append(p.grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with get_timers().span("tp.sp_grad_all_reduce", kind="comm", op="all_reduce", group="tp"):
        dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
