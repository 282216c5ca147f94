"""A megascale model as a transformers causal LM (`megascale export` writes this file beside the
weights when no standard architecture computes the same model, e.g. the parallel block with a
sliding window).

Self-contained (torch and transformers only), loaded with `trust_remote_code=True`. Written
independently of megascale's own model -- plain softmax attention with an explicit mask, key and
value heads repeated for their query heads -- so that the export tests compare two
implementations. Parameter names are megascale's. Limits: no key/value cache (generation
recomputes the whole sequence each step) and no padding mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megascale import MegascaleConfig


@dataclass
class Options:
    """megascale's model options with its defaults (config.megascale_model may omit some)."""

    vocab_size: int = 257
    seq_len: int = 256
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 0
    ffn_hidden: int = 0
    block: str = "parallel"
    parallel_norms: int = 1
    norm: str = "layernorm"
    mlp: str = "gelu"
    window: int | None = None
    positions: str = "rotary"
    tie_embeddings: bool = False
    bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    rope_base: float = 10000.0
    rotary_fraction: float = 1.0
    rope_scaling: dict = field(default_factory=dict)

    @classmethod
    def of(cls, config: MegascaleConfig) -> Options:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.megascale_model.items() if k in known})


def _norm(o: Options) -> nn.Module:
    return nn.RMSNorm(o.hidden, eps=o.norm_eps) if o.norm == "rmsnorm" else nn.LayerNorm(o.hidden, eps=o.norm_eps)


def _angles(o: Options, seq: int, device: torch.device) -> torch.Tensor:
    """Rotary angles [seq, rotating dims / 2], with Llama 3's frequency scaling when configured."""
    d = o.hidden // o.heads
    dims = int(d * o.rotary_fraction)
    freq = 1.0 / o.rope_base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    s = o.rope_scaling
    if s.get("kind", "none") == "llama3":
        low_wave = s["original_max_positions"] / s["low_freq_factor"]
        high_wave = s["original_max_positions"] / s["high_freq_factor"]
        new = []
        for f in freq.tolist():
            wave = 2 * math.pi / f
            if wave < high_wave:
                new.append(f)
            elif wave > low_wave:
                new.append(f / s["factor"])
            else:
                t = (s["original_max_positions"] / wave - s["low_freq_factor"]) / (
                    s["high_freq_factor"] - s["low_freq_factor"]
                )
                new.append((1 - t) * f / s["factor"] + t * f)
        freq = torch.tensor(new, dtype=torch.float64)
    return torch.arange(seq, dtype=torch.float64)[:, None] * freq[None, :]


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + half) of the first 2 * angles.shape[-1] dims of each head."""
    half = angles.shape[-1]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, o: Options) -> None:
        super().__init__()
        self.o = o
        self.kv = o.kv_heads or o.heads
        self.d = o.hidden // o.heads
        self.qkv = nn.Linear(o.hidden, (o.heads + 2 * self.kv) * self.d, bias=o.bias or o.qkv_bias)
        self.proj = nn.Linear(o.hidden, o.hidden, bias=o.bias)
        self.q_norm = nn.RMSNorm(self.d, eps=o.norm_eps) if o.qk_norm else None
        self.k_norm = nn.RMSNorm(self.d, eps=o.norm_eps) if o.qk_norm else None

    def forward(self, x: torch.Tensor, angles: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        per = self.o.heads // self.kv
        rows = self.qkv(x).view(b, s, self.kv, per + 2, self.d)  # per group: its queries, key, value
        q = rows[:, :, :, :per].reshape(b, s, self.o.heads, self.d).transpose(1, 2)
        k = rows[:, :, :, per].transpose(1, 2).repeat_interleave(per, dim=1)
        v = rows[:, :, :, per + 1].transpose(1, 2).repeat_interleave(per, dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if angles is not None:
            q, k = _rotate(q, angles), _rotate(k, angles)
        i = torch.arange(s, device=x.device)
        allowed = i[None, :] <= i[:, None]
        if self.o.window is not None:
            allowed &= i[None, :] > i[:, None] - self.o.window
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, s, self.o.hidden))


class MLP(nn.Module):
    def __init__(self, o: Options) -> None:
        super().__init__()
        self.kind = o.mlp
        ffn = o.ffn_hidden or 4 * o.hidden
        self.fc = nn.Linear(o.hidden, 2 * ffn if o.mlp == "swiglu" else ffn, bias=o.bias)
        self.proj = nn.Linear(ffn, o.hidden, bias=o.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.fc(x)
        if self.kind == "swiglu":  # rows interleave gate and up
            inner = F.silu(up[..., 0::2]) * up[..., 1::2]
        else:
            inner = F.gelu(up, approximate="tanh" if self.kind == "gelu" else "none")
        return self.proj(inner)


class Block(nn.Module):
    def __init__(self, o: Options) -> None:
        super().__init__()
        self.serial = o.block == "serial"
        self.ln1 = _norm(o)
        self.ln2 = _norm(o) if self.serial or o.parallel_norms == 2 else None
        self.attn = Attention(o)
        self.mlp = MLP(o)

    def forward(self, x: torch.Tensor, angles: torch.Tensor | None) -> torch.Tensor:
        if self.serial:
            x = x + self.attn(self.ln1(x), angles)
            return x + self.mlp(self.ln2(x))
        attn = self.attn(self.ln1(x), angles)
        return x + attn + self.mlp(self.ln1(x) if self.ln2 is None else self.ln2(x))


class Embed(nn.Module):
    def __init__(self, o: Options) -> None:
        super().__init__()
        self.tokens = nn.Embedding(o.vocab_size, o.hidden)
        self.positions = nn.Embedding(o.seq_len, o.hidden) if o.positions == "learned" else None


class Head(nn.Module):
    def __init__(self, o: Options) -> None:
        super().__init__()
        self.norm = _norm(o)
        self.out = nn.Linear(o.hidden, o.vocab_size, bias=False)


class MegascaleForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegascaleConfig
    base_model_prefix = "megascale"
    _tied_weights_keys = {"head.out.weight": "embed.tokens.weight"}  # when tie_word_embeddings

    def __init__(self, config: MegascaleConfig) -> None:
        super().__init__(config)
        self.o = Options.of(config)
        self.embed = Embed(self.o)
        self.blocks = nn.ModuleList(Block(self.o) for _ in range(self.o.layers))
        self.head = Head(self.o)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed.tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.head.out

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this megascale export has no padding mask: pass unpadded sequences")
        seq = input_ids.shape[1]
        h = self.embed.tokens(input_ids)
        angles = None
        if self.embed.positions is not None:
            h = h + self.embed.positions.weight[:seq]
        else:
            angles = _angles(self.o, seq, input_ids.device).to(input_ids.device)
        for block in self.blocks:
            h = block(h, angles)
        logits = self.head.out(self.head.norm(h))
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, **kwargs) -> dict:
        return {"input_ids": input_ids}  # no cache: the whole sequence every step
