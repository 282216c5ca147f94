"""How one megascale parameter is made of a checkpoint's tensors, and back.

A `Rule` names the tensors of the other format that one megascale parameter comes from and the
pair of functions that joins them into it (import) and splits it into them (export); the two
are inverses, which the round-trip tests check against `transformers` itself. The joins are
the layouts that matter: the group-major QKV projection (per key/value group its query heads,
then its key and value head), SwiGLU's interleaved gate/up rows, GPT-2's transposed `Conv1D`
weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Join = Callable[[list[torch.Tensor]], torch.Tensor]
Split = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class Rule:
    sources: tuple[str, ...]  # names in the other format, in the order `join` takes them
    join: Join
    split: Split


def same(name: str) -> Rule:
    return Rule((name,), lambda ts: ts[0], lambda t: [t])


def transposed(name: str) -> Rule:
    """GPT-2's Conv1D stores a linear layer's weight as [in, out]."""
    return Rule((name,), lambda ts: ts[0].t(), lambda t: [t.t().contiguous()])


def copies(*names: str) -> Rule:
    """One tensor written under several names (GPT-NeoX's two norms from the parallel block's
    one); read from the first."""
    return Rule(names, lambda ts: ts[0], lambda t: [t.clone() for _ in names])  # files share no storage


def group_major(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_groups: int) -> torch.Tensor:
    """Separate q [heads*d, ...], k and v [kv*d, ...] -> rows per group: its query heads, k, v."""
    rest = q.shape[1:]
    parts = [t.reshape(kv_groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_group_major(qkv: torch.Tensor, heads: int, kv_groups: int) -> list[torch.Tensor]:
    """The inverse of `group_major`: [q, k, v]."""
    rest = qkv.shape[1:]
    d = qkv.shape[0] // (heads + 2 * kv_groups)
    per = heads // kv_groups * d
    grouped = qkv.reshape(kv_groups, -1, *rest)
    parts = grouped[:, :per], grouped[:, per : per + d], grouped[:, per + d :]
    return [p.reshape(-1, *rest).contiguous() for p in parts]


def separate_qkv(q: str, k: str, v: str, heads: int, kv_groups: int) -> Rule:
    """Llama-style q_proj, k_proj, v_proj (weights or biases)."""
    return Rule((q, k, v), lambda ts: group_major(*ts, kv_groups), lambda t: split_group_major(t, heads, kv_groups))


def fused_qkv_conv1d(name: str, heads: int, bias: bool) -> Rule:
    """GPT-2's c_attn: [h, 3h] (bias [3h]) with all queries, then all keys, then all values."""

    def join(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0] if bias else ts[0].t()
        return group_major(*t.chunk(3, dim=0), heads)

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        whole = torch.cat(split_group_major(t, heads, heads))
        return [whole if bias else whole.t().contiguous()]

    return Rule((name,), join, split)


def gate_up(gate: str, up: str) -> Rule:
    """SwiGLU's gate_proj and up_proj -> megascale's interleaved rows (gate 0, up 0, gate 1, ...)."""

    def join(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(ts, dim=1).reshape(-1, *ts[0].shape[1:])

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        pairs = t.reshape(-1, 2, *t.shape[1:])
        return [pairs[:, 0].contiguous(), pairs[:, 1].contiguous()]

    return Rule((gate, up), join, split)
