"""Ring attention: full causal attention over a sequence split along its length over the cp ranks.

Without a window every query may see every earlier key, so the keys and values of every rank
must reach every later one. They go around the cp ring: at step i rank r holds the keys/values
of rank r - i (mod c), sends them on to r + 1 and receives r - i - 1's from r - 1 while it
computes its queries' attention over the block it holds (`_Ring`: isend/irecv posted before
the block's kernel call, waited for after it). Each block's kernel returns the output and the
log-sum-exp of every query row (`attention_with_lse`, FlashAttention's contract), and the
blocks' partial results merge exactly: out = sum_i exp(lse_i - lse) * out_i, lse = logaddexp.

The causal load balance (`balanced_chunks`): the sequence is cut into 2c chunks and rank r holds
chunks r and 2c - 1 - r (an early and the mirrored late one), so every rank has the same number
of visible query-key pairs. With that layout the block of rank src is, for rank r:
  - src == r (step 0): causal attention over the local keys (chunk r precedes 2c - 1 - r);
  - src < r: both local chunks see all of src's first chunk and none of its second;
  - src > r: only the second local chunk sees src's keys, all of them;
so after step 0 every step is one full `L x 2L` block (L = s / 2c): no rank idles.

The backward goes around the ring again: the keys/values circulate as in the forward, and
with them an accumulator of their gradients (`[2, ...]`: dK, dV) to which each rank adds its
block's share (computed from the whole row's output and log-sum-exp, so a block's share is
exact) before passing it on; after c steps every accumulator is back at its owner. Each send
and receive is posted before the step's kernel call and waited for after it. The result
equals one process's causal attention over the whole sequence (tests/parallel/test_context_parallel.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd import Function

from megascale.model.sliding_window import attention_with_lse, attention_with_lse_backward

FORWARD_TAG, BACKWARD_TAG, GRAD_TAG = 1000, 2000, 3000  # + step: one tag per message of a layer


def balanced_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two of the 2 * size chunks of a sequence that cp rank `rank` holds."""
    return rank, 2 * size - 1 - rank


def _block(rank: int, src: int, half: int) -> tuple[slice, slice, bool]:
    """Which local query rows see which rows of rank `src`'s keys, and whether causally."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _accumulator(x: torch.Tensor) -> torch.Tensor:
    """Sums in fp32 at least (fp64 stays fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class _Ring:
    """The cp group as a ring: messages go to the next rank and come from the previous one."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def post(self, send: torch.Tensor | None, receive: torch.Tensor | None, tag: int) -> list[dist.Work]:
        """Start sending `send` to the next rank and receiving `receive` from the previous one, as
        one batch (`batch_isend_irecv`, as ring attention implementations on NCCL do, so that no
        rank's send can wait behind its own receive around the ring; run on gloo only so far)."""
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
        if receive is not None:
            ops.append(dist.P2POp(dist.irecv, receive, self.prev, self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []

    def wait(self, works: list[dist.Work]) -> None:
        for work in works:
            work.wait()


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, m: torch.Tensor) -> None:
    """Fold a block's (output, log-sum-exp) into the rows' running ones, in place."""
    total = torch.logaddexp(lse, m)
    out.mul_((lse - total).exp_().unsqueeze(-1)).add_(o * (m - total).exp_().unsqueeze(-1))
    lse.copy_(total)


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> torch.Tensor:
        scale, half = 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            last = step + 1 == ring.size
            incoming = None if last else torch.empty_like(kv)
            works = ring.post(None if last else kv, incoming, FORWARD_TAG + step)
            rows, keys, causal = _block(ring.rank, src, half)
            o, m = attention_with_lse(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], None, scale, causal)
            if out is None or lse is None:
                out, lse = _accumulator(o).clone(), m.clone()
            else:
                _merge(out[:, :, rows], lse[:, :, rows], o, m)
            ring.wait(works)
            if incoming is not None:
                kv = incoming
        assert out is not None and lse is not None
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        half, grad_out = q.shape[2] // 2, grad_out.contiguous()
        grad_q = torch.zeros_like(_accumulator(q))
        kv = torch.stack([k, v])
        sent: list[dist.Work] = []
        received = None  # the accumulator of the block held, from the previous rank
        pending: list[dist.Work] = []
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            last = step + 1 == ring.size
            incoming = None if last else torch.empty_like(kv)
            works = ring.post(None if last else kv, incoming, BACKWARD_TAG + step)
            next_received = torch.empty_like(_accumulator(kv))  # the accumulator of the next block (or our own)
            works_grad = ring.post(None, next_received, GRAD_TAG + step)
            rows, keys, causal = _block(ring.rank, src, half)
            dq, dk, dv = attention_with_lse_backward(
                grad_out[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, keys],
                kv[1][:, :, keys],
                out[:, :, rows],
                lse[:, :, rows],
                None,
                ctx.scale,
                causal,
            )
            grad_q[:, :, rows] += dq
            ring.wait(pending)
            grad_kv = torch.zeros_like(_accumulator(kv)) if received is None else received
            grad_kv[0][:, :, keys] += dk
            grad_kv[1][:, :, keys] += dv
            ring.wait(sent)
            sent = ring.post(grad_kv, None, GRAD_TAG + step)
            received, pending = next_received, works_grad
            ring.wait(works)
            if incoming is not None:
                kv = incoming
        ring.wait(pending)
        ring.wait(sent)
        assert received is not None
        return grad_q.to(q.dtype), received[0].to(k.dtype), received[1].to(v.dtype), None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int
) -> torch.Tensor:
    """Causal attention of this rank's queries `[b, heads, 2L, d]` (chunks `balanced_chunks(rank,
    size)` of the sequence) over the keys/values of the whole sequence, held `[b, kv_heads, 2L, d]`
    by each of the `size` ranks of `group`."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention holds two equal chunks per rank: {q.shape[2]} local positions")
    return _RingAttention.apply(q, k, v, _Ring(group, rank, size))
