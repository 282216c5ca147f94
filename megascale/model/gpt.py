"""A GPT decoder with the serial or the parallel transformer block.

Serial:   y = x + MLP(LN2(x + Attn(LN1(x))))
Parallel: y = x + MLP(LN(x)) + Attn(LN(x))      (one norm feeds both branches; GPT-NeoX: two)

Each layer option exists once, here, and composes with both blocks: LayerNorm or RMSNorm, GeLU
or SwiGLU, multi-head or grouped-query attention, full or sliding-window, rotary (partial,
Llama-3-scaled) or learned positions, biases or none, tied or untied embeddings, a dense or a
mixture-of-experts MLP (`model.moe`, megascale.model.moe).

No parallelism lives here. The model is three stages -- `embed`, `blocks`, `head` -- so that the
pipeline splitter can cut it into chunks. The block's forward is written once: tensor
parallelism swaps its `Linear` layers for column/row-parallel ones that put the communication
around the same GEMMs (megascale.parallel.tensor), and the parallel block's fused GEMMs go
through those same layers, so a fused, tensor-parallel block runs this very code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megascale.config.schema import DEFAULT_LOSS_CHUNK, ModelConfig
from megascale.model.attention import KVCache, causal_attention
from megascale.model.init import TorchInitSkipped, initial_value
from megascale.model.loss import IGNORE_INDEX as IGNORE_INDEX  # re-exported: the labels' ignore value
from megascale.model.loss import chunked_cross_entropy
from megascale.model.moe import MoE
from megascale.model.rotary import apply_rotary, rotary_tables, scaling_key


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.positions = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.positions == "learned" else None
        self.context = None  # context parallelism: this rank's part of the sequence (parallel.context)

    def forward(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """`offset`: the position of the first token (generation with a KV cache)."""
        h = self.tokens(tokens)
        if self.positions is not None:
            n = tokens.shape[1]
            where = slice(offset, offset + n) if self.context is None else self.context.positions(n, tokens.device)
            h = h + self.positions.weight[where]
        return h


class Linear(nn.Linear):
    """`nn.Linear` whose GEMM can run on other weights: the parallel block's fused GEMMs call
    `project` with concatenated weights, and tensor parallelism overrides `project` to put its
    collectives around the GEMM (a row-parallel layer adds its bias after the reduction)."""

    def project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.weight, self.bias)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.queries_per_group = cfg.heads // cfg.kv_groups
        self.window = cfg.window
        self.rotary = cfg.positions == "rotary"
        self.rope = (cfg.rotary_dim, cfg.rope_base, scaling_key(cfg.rope_scaling))
        self.kernel = "auto"
        self.cache: KVCache | None = None  # set while generating (interop.generate)
        self.context = None  # context parallelism: attends across the cp ranks (parallel.context)
        self.qkv = Linear(cfg.hidden, cfg.qkv_width, bias=cfg.bias or cfg.qkv_bias)
        self.proj = Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        # Qwen 3: each query and key head RMS-normalised (one weight shared by the heads)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """[b, s, groups*(q+2)*d] -> [b, s, groups*q*d].

        The QKV projection is laid out group-major: for each key/value group, its query heads,
        then its key head, then its value head (with multi-head attention a group is one head:
        q, k, v of head 0, then of head 1, ...). A contiguous slice of its rows is a set of whole
        groups, so tensor parallelism splits it without reordering, for any number of local
        groups."""
        b, s, width = qkv.shape
        per_group = self.queries_per_group
        groups = width // ((per_group + 2) * self.head_dim)
        grouped = qkv.view(b, s, groups, per_group + 2, self.head_dim)
        q = grouped[:, :, :, :per_group].reshape(b, s, groups * per_group, self.head_dim).transpose(1, 2)
        k, v = grouped[:, :, :, per_group].transpose(1, 2), grouped[:, :, :, per_group + 1].transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            past = self.cache.seen if self.cache is not None else 0
            where = slice(past, past + s) if self.context is None else self.context.positions(s, qkv.device)
            end = past + s if self.context is None else s * self.context.size  # the whole sequence's
            cos, sin = rotary_tables(end, *self.rope, qkv.device, qkv.dtype)
            cos, sin = cos[where], sin[where]  # once for q and k (ring attention's positions are an index)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.cache is not None:
            out = self.cache.attend(q, k, v, self.kernel)
        elif self.context is not None:
            out = self.context.attend(q, k, v, self.window)
        else:
            out = causal_attention(q, k, v, self.window, self.kernel)
        return out.transpose(1, 2).reshape(b, s, groups * per_group * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x)))


class MLP(nn.Module):
    """GeLU (tanh-approximated or exact) or SwiGLU. SwiGLU's gate and up projections are one
    layer whose rows interleave them (gate 0, up 0, gate 1, up 1, ...), so that a contiguous
    slice of rows -- a tensor-parallel slice -- holds matching gate and up columns."""

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        """`width`: the hidden width (default the model's ffn; an MoE expert's own)."""
        super().__init__()
        self.kind = cfg.mlp
        width = width or cfg.ffn
        self.fc = Linear(cfg.hidden, 2 * width if cfg.mlp == "swiglu" else width, bias=cfg.bias)
        self.proj = Linear(width, cfg.hidden, bias=cfg.bias)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            gate, up = x.unflatten(-1, (-1, 2)).unbind(-1)
            return F.silu(gate) * up
        return F.gelu(x, approximate="tanh" if self.kind == "gelu" else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        """`index`: the block's place in the model (`model.moe.every` picks the MoE blocks)."""
        super().__init__()
        self.kind = cfg.block
        self.ln1 = make_norm(cfg)
        self.ln2 = make_norm(cfg) if cfg.block == "serial" or cfg.parallel_norms == 2 else None
        self.attn = Attention(cfg)
        self.mlp = MoE(cfg, lambda width: MLP(cfg, width)) if cfg.moe.is_moe_layer(index) else MLP(cfg)
        # Parallel block with one norm only: QKV and the MLP up-projection as one GEMM over the
        # concatenated weights (one pass over the norm's output; under tensor parallelism one
        # gather), and both output projections as one (one reduce-scatter). Speed only.
        self.fuse_gemms = False

    @property
    def fusable(self) -> bool:
        """Both branches read the same input (MegaScale's parallel block) and the MLP is dense."""
        return self.kind == "parallel" and self.ln2 is None and isinstance(self.mlp, MLP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "serial":
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        h = self.ln1(x)
        if self.fuse_gemms:
            return x + self._fused_branches(h)
        return x + self.mlp(h if self.ln2 is None else self.ln2(x)) + self.attn(h)

    def _fused_branches(self, h: torch.Tensor) -> torch.Tensor:
        """Attn(h) + MLP(h) with one GEMM in and one GEMM out. The concatenated weights are
        not kept for the backward (`JoinedWeight`): a copy of the layer's weights per
        micro-batch in flight was most of what a large tensor-parallel layer saved."""
        attn, mlp = self.attn, self.mlp
        joined_in = JoinedWeight((attn.qkv.weight, mlp.fc.weight), dim=0, like=h)
        with joined_in.rebuilt_in_backward():
            out = attn.qkv.project(h, joined_in.weight, _joined_bias(attn.qkv, mlp.fc))
        qkv, up = out.split([attn.qkv.weight.shape[0], mlp.fc.weight.shape[0]], dim=-1)
        inner = torch.cat([attn.attend(qkv), mlp.activation(up)], dim=-1)
        joined_out = JoinedWeight((attn.proj.weight, mlp.proj.weight), dim=1, like=inner)
        biases = [b for b in (attn.proj.bias, mlp.proj.bias) if b is not None]
        with joined_out.rebuilt_in_backward():
            return attn.proj.project(inner, joined_out.weight, sum(biases) if biases else None)


class JoinedWeight:
    """Parameters concatenated for one GEMM, saved for its backward as a recipe, not a copy.

    `weight` is `torch.cat(parts, dim)` in the dtype the GEMM runs in (under autocast the
    parts are cast first, so that no cast copy of the concatenation is made and saved either:
    the values are the same as casting the concatenation). While `rebuilt_in_backward()` is
    active, saved-tensor hooks replace every tensor that autograd (or a custom Function) saves
    *on the concatenation's storage* -- itself, a transpose, a detached alias -- by the recipe,
    and the backward that needs it rebuilds it from the parameters, which do not change within
    a step (the optimizer runs after every backward). Other saved tensors go to the hooks that
    were active outside (activation recomputation's, a memory probe's), so this composes with
    them; under `torch.compile` the hooks stand aside (the compiler plans saved tensors itself)."""

    def __init__(self, parts: tuple[torch.Tensor, ...], dim: int, like: torch.Tensor) -> None:
        device = like.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else parts[0].dtype
        self.recipe = _Recipe(parts, dim, dtype)  # what the saved tensors keep: no values
        self.weight = torch.cat([p.to(dtype) for p in parts], dim)

    @contextlib.contextmanager
    def rebuilt_in_backward(self) -> Iterator[None]:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            yield
            return
        key, recipe = self.weight.untyped_storage()._cdata, self.recipe  # the hooks outlive the forward: not self
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (no public reader)

        def pack(t: torch.Tensor) -> object:
            if t.untyped_storage()._cdata == key:
                return _Rebuild(recipe, tuple(t.shape), t.stride(), t.storage_offset())
            return t if outer is None else _Outer(outer[0](t))

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, _Rebuild):
                return packed.recipe.build().as_strided(packed.shape, packed.stride, packed.offset)
            return packed if outer is None else outer[1](packed.packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


@dataclass(frozen=True)
class _Recipe:
    parts: tuple[torch.Tensor, ...]
    dim: int
    dtype: torch.dtype

    def build(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.detach().to(self.dtype) for p in self.parts], self.dim)


@dataclass(frozen=True)
class _Rebuild:
    recipe: _Recipe
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Outer:
    packed: object  # what the outer pack hook returned


def _joined_bias(*layers: nn.Linear) -> torch.Tensor | None:
    """The biases of layers whose outputs are concatenated (zeros for a layer without one)."""
    if all(layer.bias is None for layer in layers):
        return None
    return torch.cat(
        [layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.weight.shape[0]) for layer in layers]
    )


class Head(nn.Module):
    """Final norm, vocabulary projection and the summed token loss. The loss runs the projection
    `loss_chunk` tokens at a time (`train.loss_chunk`): whole logits never exist in training."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = make_norm(cfg)
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.loss_chunk = DEFAULT_LOSS_CHUNK

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum (not mean) of token losses: the trainer divides by the global token count, so
        the loss is the true mean over the global batch whatever the layout."""
        x = self.norm(h).flatten(0, 1)
        return chunked_cross_entropy(x, self.out.weight, labels.flatten(), self.loss_chunk)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        with TorchInitSkipped():  # every value is set below
            self.embed = Embedding(cfg)
            self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
            self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.tokens.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Each parameter from `initial_value(name, seed)`; the seed defaults to torch's initial
        seed, so `torch.manual_seed(s)` before building makes the model reproducible. Parameters
        on the meta device (a rank building only its part) are left for `materialize`."""
        seed = torch.initial_seed() if seed is None else seed
        for name, p in self.named_parameters():
            if not p.is_meta:
                p.copy_(initial_value(name, tuple(p.shape), self.cfg, seed))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits without labels; the summed token loss with them."""
        h = self.hidden_states(tokens)
        return self.head.logits(h) if labels is None else self.head(h, labels)
