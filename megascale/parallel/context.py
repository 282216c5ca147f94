"""Context parallelism: a sequence split along its length over the cp ranks; only attention
crosses ranks (everything else is per token). Full causal attention goes around the ring
(`ring.py`); a sliding window needs only a halo exchange, here.

With a window (`uses_ring` false) rank r of the cp group holds positions [r * s, (r + 1) * s) of
every sequence (`split_sequence`); under ring attention it holds the two mirrored chunks r and
2c - 1 - r of 2c (the causal load balance), and the positions follow (`positions`). With a window w, query
i sees keys i - w + 1 .. i: only the first h = w - 1 local queries need keys of the previous
rank, and only its last h keys and values. So each layer:

1. posts the exchange (`_Halo.post`: isend of this rank's last h keys/values to the next rank,
   irecv of the previous rank's into a buffer; point-to-point, asynchronous);
2. computes the queries h.. over the local keys, which need nothing from elsewhere, while the
   halo is in flight;
3. waits for the halo (`_ReceiveHalo`) and computes the first h queries over halo + local keys.

In the backward the order mirrors: the first h queries' backward gives the halo's gradient,
which `_ReceiveHalo.backward` sends back to the previous rank (posted, not waited for); the
local queries' backward runs while it flies; last, `_TailGrad` (an identity on the keys/values,
so its backward runs after every use of them) waits for the next rank's gradient of this rank's
last h keys/values and adds it. Autograd runs ready nodes latest-created first, which gives
this order. The result equals one process's attention over the whole sequence (tests/parallel/
test_context_parallel.py); the positions (rotary, learned) start at r * s (`positions`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from megascale.config.fields import ConfigError
from megascale.data import TokenBatch
from megascale.model.attention import causal_attention
from megascale.model.sliding_window import sliding_window_attention
from megascale.parallel.ring import balanced_chunks, ring_attention
from megascale.parallel.timed_comm import timed_all_reduce

FORWARD_TAG, BACKWARD_TAG = 35, 36


def uses_ring(window: int | None, seq_len: int) -> bool:
    """Full causal attention (no window, or one as long as the sequence) goes around the ring."""
    return window is None or window >= seq_len


def split_sequence(x: torch.Tensor, rank: int, size: int, dim: int = 1, ring: bool = False) -> torch.Tensor:
    """Rank `rank`'s part of `x` along the sequence dimension `dim`: one contiguous part of
    `size`, or under ring attention chunks `balanced_chunks(rank, size)` of 2 * size."""
    parts = 2 * size if ring else size
    if x.shape[dim] % parts:
        raise ConfigError(
            f"model.seq_len {x.shape[dim]} is not divisible by {'2 * ' if ring else ''}parallel.cp = {parts}; "
            "choose a cp that divides it"
        )
    if not ring:
        return x.chunk(size, dim)[rank]
    chunks = x.chunk(parts, dim)
    return torch.cat([chunks[i] for i in balanced_chunks(rank, size)], dim)


def split_batch(batch: TokenBatch, rank: int, size: int, ring: bool = False) -> TokenBatch:
    """This cp rank's part of every sequence of a `[micro_batches, micro, seq]` batch."""
    return replace(
        batch,
        inputs=split_sequence(batch.inputs, rank, size, 2, ring),
        labels=split_sequence(batch.labels, rank, size, 2, ring),
    )


def sum_grads_over(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """Sum the gradients over the cp group: every cp rank holds the same parameters (or ZeRO
    shards: the same ones, cp ranks share their dp coordinate) and saw part of each sequence."""
    for _, tensor in named:
        if tensor.grad is not None:
            timed_all_reduce(tensor.grad, group, dim="cp")


class _Halo:
    """One layer's exchange with the neighbours: the previous rank's last h keys/values in, this
    rank's out; in the backward their gradients the other way."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, halo: int):
        self.group, self.rank, self.size, self.halo = group, rank, size, halo
        self.works: list[dist.Work] = []
        self.received: torch.Tensor | None = None
        self.grad_works: list[dist.Work] = []
        self.grad_received: torch.Tensor | None = None

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def post(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.rank + 1 < self.size:
            tail = torch.stack([k[:, :, -self.halo :], v[:, :, -self.halo :]]).contiguous()
            self.works.append(dist.isend(tail, self._peer(self.rank + 1), group=self.group, tag=FORWARD_TAG))
        if self.rank > 0:
            self.received = k.new_empty(2, k.shape[0], k.shape[1], self.halo, k.shape[3])
            self.works.append(dist.irecv(self.received, self._peer(self.rank - 1), group=self.group, tag=FORWARD_TAG))

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def post_grad(self, grad: torch.Tensor | None, like: torch.Tensor) -> None:
        if self.rank > 0:
            grad = torch.zeros_like(self.received) if grad is None else grad.contiguous()
            self.grad_works.append(dist.isend(grad, self._peer(self.rank - 1), group=self.group, tag=BACKWARD_TAG))
        if self.rank + 1 < self.size:
            self.grad_received = like.new_empty(2, like.shape[0], like.shape[1], self.halo, like.shape[3])
            self.grad_works.append(
                dist.irecv(self.grad_received, self._peer(self.rank + 1), group=self.group, tag=BACKWARD_TAG)
            )

    def wait_grad(self) -> torch.Tensor | None:
        for work in self.grad_works:
            work.wait()
        self.grad_works = []
        return self.grad_received


class _TailGrad(Function):
    """Identity on k, v; backward: adds the next rank's gradient of their last h rows, waited for
    only after every local use of k, v has been differentiated."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, halo: _Halo) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.halo = halo
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor, grad_v: torch.Tensor):
        halo: _Halo = ctx.halo
        received = halo.wait_grad()
        if received is not None:
            # in place: autograd summed these from k's and v's uses into buffers of its own that
            # nothing else holds; a copy of each was two more [s, kv] tensors at the backward's peak
            grad_k[:, :, -halo.halo :] += received[0]
            grad_v[:, :, -halo.halo :] += received[1]
        return grad_k, grad_v, None


class _ReceiveHalo(Function):
    """Waits for the previous rank's last h keys and values `[2, b, g, h, d]` (empty on rank 0);
    backward: posts their gradient back to it, and this rank's receive of its own tail's."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, halo: _Halo) -> torch.Tensor:
        halo.wait()
        ctx.halo, ctx.like = halo, k.detach()
        if halo.received is None:
            return k.new_empty(2, k.shape[0], k.shape[1], 0, k.shape[3])
        return halo.received

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        ctx.halo.post_grad(grad, ctx.like)
        return None, None


class ContextParallel:
    """This rank's place in its cp group, given to every attention and embedding layer
    (`apply_context_parallel`); `ring`: full causal attention, the balanced layout."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, ring: bool = False):
        self.group, self.rank, self.size, self.ring = group, rank, size, ring

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor | slice:
        """The sequence positions of this rank's `local_len` tokens, in order: a slice where they
        are contiguous, so that the position and rotary tables are indexed as views (an index
        tensor copied cos and sin for q and for k in every layer, all kept for the backward)."""
        if not self.ring:
            return slice(self.rank * local_len, (self.rank + 1) * local_len)
        chunk = local_len // 2
        return torch.cat(
            [torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in balanced_chunks(self.rank, self.size)]
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        """Attention of the local queries over the whole sequence's keys within the window."""
        s = q.shape[2]
        if self.ring:
            if self.size == 1:
                return causal_attention(q, k, v, None)
            return ring_attention(q, k, v, self.group, self.rank, self.size)
        if window is None:
            raise ConfigError(
                "parallel.cp > 1 without model.window needs the ring layout "
                "(apply_context_parallel(..., ring=True)): the halo exchange is for sliding windows"
            )
        h = window - 1
        if h > s:
            raise ConfigError(
                f"model.window {window} reaches beyond the previous rank's {s} positions "
                f"(seq_len / parallel.cp); the halo exchange needs model.window <= {s + 1}"
            )
        if h == 0 or self.size == 1:
            return sliding_window_attention(q, k, v, window)
        halo = _Halo(self.group, self.rank, self.size, h)
        halo.post(k.detach(), v.detach())
        k, v = _TailGrad.apply(k, v, halo)
        local = sliding_window_attention(q[:, :, h:], k, v, window)  # while the halo flies
        received = _ReceiveHalo.apply(k, halo)
        head_k = torch.cat([received[0], k[:, :, :h]], dim=2)
        head_v = torch.cat([received[1], v[:, :, :h]], dim=2)
        head = sliding_window_attention(q[:, :, :h], head_k, head_v, window)
        return torch.cat([head, local], dim=2)


def apply_context_parallel(
    model: nn.Module, group: dist.ProcessGroup | None, rank: int, size: int, ring: bool = False
) -> None:
    """Give every layer that needs to know it this rank's place in the sequence."""
    context = ContextParallel(group, rank, size, ring)
    for module in model.modules():
        if hasattr(module, "context"):
            module.context = context
