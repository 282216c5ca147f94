"""ZeRO-2 over the data-parallel group, per model chunk, with the collectives overlapped; the
home of the fp32 master weights in every layout (dp = 1 is ZeRO over a group of one).

Parameters stay whole (replicated over dp) in the model, so forward and backward are the
single-process code. Gradients are reduce-scattered into per-rank fp32 shards and the optimizer
(with its state) only sees this rank's shards; after the step the updated shards are
all-gathered back into the parameters. The shards are the fp32 master weights: with
`train.param_dtype = "bf16"` the parameters are bf16 copies rounded once per step from them,
so an update too small for bf16 still accumulates in fp32 (and so do the optimizer's moments,
created like the tensors they belong to). The reduce-scatter runs in `train.reduce_dtype`
(fp32 by default: bf16 gradients are widened before they are summed), the all-gather in the
parameters' dtype (bf16 moves half the bytes). At dp = 1 there is no collective: a shard is
the whole (tensor-parallel slice of the) parameter, shaped like it; gradients are copied into
the fp32 shard gradients, and the masters rounded into the parameters. With fp32 parameters at
dp = 1 the parameter *is* its master (it views the shard's storage), so nothing is copied back
and nothing is held twice.

Layout: a chunk's parameters are packed, in backward order, into buckets. Inside a bucket each
parameter (its tensor-parallel slice, flattened and zero-padded to a multiple of dp) is cut into
dp equal pieces, and the bucket's flat buffer is `[rank 0's pieces | rank 1's pieces | ...]`,
so one `reduce_scatter` leaves each rank a contiguous region holding its piece of every
parameter, and one `all_gather` of those regions rebuilds the buffer. A rank's shard of a
parameter is a view of that region; its `ShardSpec` records the flat range of the tp slice it
covers (for resharding checkpoints) and the process groups whose pieces make up the whole
parameter (for LAMB's trust ratio and clipping).

Overlap (`parallel.dp_overlap`): each bucket's reduce-scatter is launched as soon as the last
micro-batch's backward has produced every gradient in it (counted by post-accumulate-grad
hooks; `after_backward` launches whatever is left); the all-gather of chunk 0 is launched right
after the optimizer step, so it overlaps the next step's data loading, and the all-gather of
chunk i+1 is launched when chunk i's forward starts, the order in which forwards consume them.
With overlap off every collective runs synchronously at the end of the step.

Memory: only the fp32 master shards live across steps; the shard gradients exist from a
bucket's reduce-scatter to `zero_grad` (after the optimizer step). The communication buffers
(a bucket's reduce-scatter input and all-gather output, `dp × region` elements: the bucket
unsharded) exist only while a bucket is being filled or is in flight, at most `IN_FLIGHT` of
each kind at once: launching a reduce-scatter first waits for the oldest one still in flight,
and a chunk's all-gathers are issued `IN_FLIGHT` buckets ahead of the copy-out. (Allocated up
front they held the stage's parameters once more, at 4 bytes each.) A gradient moves into its
bucket's reduce-scatter input when its last micro-batch's backward has made it final, and the
parameter's `.grad` is dropped then, so a final gradient is never held twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megascale.config.schema import JobConfig
from megascale.diagnostics.timers import get_timers
from megascale.layout.shard import set_shard_spec, shard_spec
from megascale.parallel.tp_comm import all_gather_single, reduce_scatter_single

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IN_FLIGHT = 2  # buckets whose reduce-scatter (or all-gather) buffers exist at once


@dataclass
class _Slot:
    """One parameter inside a bucket."""

    name: str
    param: nn.Parameter
    piece: int  # elements per rank (padded numel / dp)
    offset: int  # where its piece starts inside a rank's region
    shard: torch.Tensor | None = None  # fp32 view of the bucket's shard region
    hook_calls: int = 0
    moved: bool = False  # its final gradient is in the bucket's reduce-scatter input already


@dataclass
class _Bucket:
    """The persistent fp32 regions of a bucket and, while it communicates, its buffers."""

    slots: list[_Slot]
    region: int  # elements per rank
    shard: torch.Tensor  # [region] fp32 master values (the optimizer steps on views of it)
    param_dtype: torch.dtype  # the all-gather's dtype
    grad: torch.Tensor | None = None  # [region] fp32 dp-summed gradients, from the launch to zero_grad
    send: torch.Tensor | None = None  # [dp * region] reduce-scatter input, reduce dtype (dp = 1: grad)
    recv: torch.Tensor | None = None  # [region] reduce-scatter output, reduce dtype (grad when fp32)
    gathered: torch.Tensor | None = None  # [dp * region] all-gather output in the parameters' dtype
    low: torch.Tensor | None = None  # [region] all-gather input: the masters in that dtype (shard when fp32)
    work: dist.Work | None = None  # the collective in flight (reduce-scatter, or all-gather)
    ready: int = 0  # slots whose gradient is final this step
    launched: bool = False


@dataclass
class _Chunk:
    buckets: list[_Bucket]
    fresh: bool = True  # parameters hold the latest shards
    aliased: bool = False  # dp = 1 and fp32: the parameters are their masters, always fresh
    gather: list[_Bucket] | None = None  # buckets still to copy out, in order (first ones in flight)
    hooks: list = field(default_factory=list)


class ZeroGradSync:
    """The `grad_sync` hooks of a runner: ZeRO-2 sharding of gradients and optimizer state."""

    def __init__(
        self,
        chunks: list[nn.Module],
        cfg: JobConfig,
        mesh=None,
        select: Callable[[str], bool] | None = None,
        over: tuple | None = None,
    ):
        """`mesh` None (or dp = 1): the group of one, with no collective. `select`: the
        parameters (by name) this instance holds, default all; `over`: (group, size, rank) to
        shard over instead of the mesh's dp (expert parameters: their expert-data group)."""
        if over is None:
            over = (None, 1, 0) if mesh is None else (mesh.dp_group, mesh.dp_size, mesh.dp_rank)
        self.group, self.dp, self.dp_rank = over
        self.select = select or (lambda name: True)
        self.reduce_dtype = REDUCE_DTYPES[cfg.train.reduce_dtype]
        self.overlap = cfg.parallel.dp_overlap
        # this replica's micro-batches (uneven shares: one more on the first replicas)
        self.expected_backwards = cfg.micro_batches_of(0 if mesh is None else mesh.dp_rank)
        bucket_numel = max(1, int(cfg.parallel.dp_bucket_mb * 2**20) // 4)  # fp32 elements per rank
        self._chunks = [self._build_chunk(c, bucket_numel) for c in chunks]
        self._named = [(s.name, s.shard) for ch in self._chunks for s in self._slots_in_order(ch)]
        self._in_flight: list[_Bucket] = []  # launched reduce-scatters, oldest first

    # ------------------------------------------------------------------ layout
    def _build_chunk(self, module: nn.Module, bucket_numel: int) -> _Chunk:
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad and self.select(n)]
        buckets, current, region = [], [], 0
        for name, p in reversed(params):  # backward produces the last parameters' grads first
            piece = -(-p.numel() // self.dp)
            if current and region + piece > bucket_numel:
                buckets.append(self._build_bucket(current, region))
                current, region = [], 0
            current.append(_Slot(name, p, piece, region))
            region += piece
        if current:
            buckets.append(self._build_bucket(current, region))
        chunk = _Chunk(buckets, aliased=self.dp == 1 and all(p.dtype == torch.float32 for _, p in params))
        if self.overlap:
            for bucket in buckets:
                for slot in bucket.slots:
                    chunk.hooks.append(
                        slot.param.register_post_accumulate_grad_hook(
                            lambda _p, b=bucket, s=slot: self._grad_ready(b, s)
                        )
                    )
        return chunk

    def _build_bucket(self, slots: list[_Slot], region: int) -> _Bucket:
        device = slots[0].param.device
        shard = torch.zeros(region, dtype=torch.float32, device=device)
        bucket = _Bucket(slots, region, shard, slots[0].param.dtype)  # gathered in the parameters' dtype
        for slot in slots:
            p = slot.param
            piece = shard[slot.offset : slot.offset + slot.piece]
            with torch.no_grad():
                piece.copy_(self._pieces(p.detach().reshape(-1), slot.piece)[self.dp_rank])
            if self.dp == 1:  # the whole (tp slice of the) parameter, shaped like it
                piece = piece.view(p.shape)
                spec = shard_spec(p)
                if p.dtype == torch.float32:
                    p.data = piece  # the parameter is its own master: one copy, none made per step
            else:
                start = self.dp_rank * slot.piece
                spec = shard_spec(p).with_flat_range(start, start + slot.piece).split_over(self.group)
            set_shard_spec(piece, spec)
            slot.shard = piece
        return bucket

    def _pieces(self, flat: torch.Tensor, piece: int) -> torch.Tensor:
        """[numel] -> [dp, piece], zero-padded at the end."""
        pad = self.dp * piece - flat.numel()
        return (F.pad(flat, (0, pad)) if pad else flat).view(self.dp, piece)

    @staticmethod
    def _slots_in_order(chunk: _Chunk) -> list[_Slot]:
        """A chunk's slots in parameter-registration order (buckets are in backward order)."""
        return [s for b in reversed(chunk.buckets) for s in reversed(b.slots)]

    # ------------------------------------------------------------------ runner hooks
    def before_forward(self, chunk_index: int) -> None:
        """Make the chunk's parameters current, then prefetch the next chunk's."""
        self._wait_gather(chunk_index)
        nxt = chunk_index + 1
        if self.overlap and nxt < len(self._chunks):
            self._start_gather(nxt)

    def after_backward(self, chunk_index: int) -> None:
        """The chunk's gradients are complete: launch the reduce-scatters not yet launched."""
        if self.overlap:
            for bucket in self._chunks[chunk_index].buckets:
                self._launch_reduce_scatter(bucket)

    def finish(self) -> None:
        """Wait every reduce-scatter; each shard's .grad then holds the dp-sum of its range."""
        for chunk in self._chunks:
            for bucket in chunk.buckets:
                self._launch_reduce_scatter(bucket)  # those not launched yet (a copy at dp = 1)
        while self._in_flight:
            self._complete(self._in_flight[0])
        for chunk in self._chunks:
            for bucket in chunk.buckets:
                bucket.launched, bucket.ready = False, 0
                for slot in bucket.slots:
                    slot.shard.grad = bucket.grad[slot.offset : slot.offset + slot.piece].view_as(slot.shard)
                    slot.hook_calls, slot.moved = 0, False

    def after_step(self) -> None:
        """The shards were updated: refresh the parameters (chunk 0 now, the rest on demand)."""
        for chunk in self._chunks:
            chunk.fresh = chunk.aliased
        if self.overlap:
            self._start_gather(0)
            return
        for index in range(len(self._chunks)):
            self._wait_gather(index)

    def optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's fp32 shards, named like their parameters."""
        return list(self._named)

    def zero_grad(self) -> None:
        """Drop the shard gradients and the fp32 regions behind them (made again next step)."""
        for _, shard in self._named:
            shard.grad = None
        for chunk in self._chunks:
            for bucket in chunk.buckets:
                bucket.grad = None

    def memory_bytes(self) -> dict[str, int]:
        """What this instance holds at its peak, by kind (memory accounting without running a
        step, e.g. `testing/fake_memory.py`): `masters` the fp32 shards, `grads` their fp32
        gradients (from the reduce-scatters to `zero_grad`), `buffers` the most the
        communication buffers take at once (`IN_FLIGHT` of the largest buckets')."""
        buckets = [b for ch in self._chunks for b in ch.buckets]
        fp32 = 4 * sum(b.region for b in buckets)
        if self.dp == 1:  # no collective: the fp32 regions are the buffers
            return {"masters": fp32, "grads": fp32, "buffers": 0}
        largest = sorted(buckets, key=lambda b: b.region, reverse=True)[:IN_FLIGHT]
        # [dp * region] in and, when not fp32, a [region] reduce-scatter output / all-gather input
        reduce = self.reduce_dtype
        scatter = sum(b.region * (self.dp + (reduce != torch.float32)) * reduce.itemsize for b in largest)
        gather = sum(b.region * (self.dp + (b.param_dtype != torch.float32)) * b.param_dtype.itemsize for b in largest)
        return {"masters": fp32, "grads": fp32, "buffers": max(scatter, gather)}

    def wait_params(self) -> None:
        """Make every chunk's parameters current (before evaluation or saving the model)."""
        for index in range(len(self._chunks)):
            self._wait_gather(index)

    # ------------------------------------------------------------------ reduce-scatter
    def _grad_ready(self, bucket: _Bucket, slot: _Slot) -> None:
        """Post-accumulate-grad hook: move a final gradient into its bucket's reduce-scatter
        input, and launch the bucket once its last gradient is final."""
        if bucket.launched:
            raise RuntimeError(
                f"ZeRO: gradient of {slot.name} accumulated after its bucket was reduce-scattered "
                f"(more than {self.expected_backwards} backward passes per step?)"
            )
        slot.hook_calls += 1
        if slot.hook_calls != self.expected_backwards:
            return
        if self._has_send(bucket):
            self._move(bucket, slot)
        bucket.ready += 1
        if bucket.ready == len(bucket.slots):
            self._launch_reduce_scatter(bucket)

    def _has_send(self, bucket: _Bucket, force: bool = False) -> bool:
        """Give `bucket` its reduce-scatter input if it has none and `IN_FLIGHT` allows (waiting
        for the oldest reduce-scatter in flight if need be); False if every buffer belongs to a
        bucket still being filled (its gradients then stay on the parameters until the launch),
        unless `force` (the launch itself)."""
        if bucket.send is not None:
            return True
        if self.dp == 1:  # no collective: gradients go straight into the fp32 region
            bucket.send = self._grad(bucket)
            return True
        holders = [b for ch in self._chunks for b in ch.buckets if b.send is not None]
        if len(holders) >= IN_FLIGHT:
            if self._in_flight:
                self._complete(self._in_flight[0])
            elif not force:
                return False
        bucket.send = torch.empty(self.dp * bucket.region, dtype=self.reduce_dtype, device=bucket.shard.device)
        return True

    @torch.no_grad()
    def _move(self, bucket: _Bucket, slot: _Slot) -> None:
        """The slot's gradient (zero if it has none) into its columns of the reduce-scatter input."""
        rows = bucket.send.view(self.dp, bucket.region)
        dest = rows[:, slot.offset : slot.offset + slot.piece]
        grad = slot.param.grad
        if grad is None:  # unused this step: contributes zero
            dest.zero_()
        else:
            dest.copy_(self._pieces(grad.reshape(-1), slot.piece))
            slot.param.grad = None  # ZeRO-2: only the shard's gradient outlives the step
        slot.moved = True

    @torch.no_grad()
    def _launch_reduce_scatter(self, bucket: _Bucket) -> None:
        if bucket.launched:
            return
        self._has_send(bucket, force=True)
        for slot in bucket.slots:
            if not slot.moved:
                self._move(bucket, slot)
        bucket.launched = True
        if self.dp == 1:
            bucket.send = None  # it was the fp32 region itself
            return
        if self.reduce_dtype == torch.float32:
            bucket.recv = self._grad(bucket)
        else:
            bucket.recv = torch.empty(bucket.region, dtype=self.reduce_dtype, device=bucket.shard.device)
        with self._comm_span("dp.reduce_scatter", "reduce_scatter"):
            bucket.work = reduce_scatter_single(bucket.recv, bucket.send, group=self.group, async_op=self.overlap)
        self._in_flight.append(bucket)

    def _complete(self, bucket: _Bucket) -> None:
        """Wait one reduce-scatter, keep its fp32 result, free its buffers."""
        if bucket.work is not None:
            with self._comm_span("dp.reduce_scatter", "reduce_scatter"):
                bucket.work.wait()
        if bucket.recv is not bucket.grad:
            self._grad(bucket).copy_(bucket.recv)  # the fp32 shard gradient the optimizer reads
        bucket.work, bucket.send, bucket.recv = None, None, None
        self._in_flight.remove(bucket)

    @staticmethod
    def _grad(bucket: _Bucket) -> torch.Tensor:
        """The bucket's fp32 gradient region, made when its gradients first arrive."""
        if bucket.grad is None:
            bucket.grad = torch.empty(bucket.region, dtype=torch.float32, device=bucket.shard.device)
        return bucket.grad

    def _comm_span(self, name: str, op: str):
        return get_timers().span(name, kind="comm", op=op, group="dp")

    # ------------------------------------------------------------------ all-gather
    def _start_gather(self, index: int) -> None:
        chunk = self._chunks[index]
        if chunk.fresh or chunk.gather is not None:
            return
        chunk.gather = [] if self.dp == 1 else list(chunk.buckets)  # dp = 1: rounded when waited for
        for bucket in chunk.gather[:IN_FLIGHT]:
            self._issue_gather(bucket)

    def _issue_gather(self, bucket: _Bucket) -> None:
        """The bucket's updated masters, rounded once to the parameters' dtype, gathered."""
        shard = bucket.shard
        bucket.low = shard if bucket.param_dtype == torch.float32 else shard.to(bucket.param_dtype)
        bucket.gathered = torch.empty(self.dp * bucket.region, dtype=bucket.param_dtype, device=shard.device)
        bucket.work = all_gather_single(bucket.gathered, bucket.low, group=self.group, async_op=True)

    @torch.no_grad()
    def _wait_gather(self, index: int) -> None:
        chunk = self._chunks[index]
        if chunk.fresh:
            return
        self._start_gather(index)
        pending = chunk.gather or []
        for i, bucket in enumerate(pending):
            with self._comm_span("dp.all_gather", "all_gather"):
                bucket.work.wait()
            if i + IN_FLIGHT < len(pending):
                self._issue_gather(pending[i + IN_FLIGHT])
            self._copy_out(bucket, bucket.gathered)
            bucket.work, bucket.gathered, bucket.low = None, None, None
        if self.dp == 1:
            for bucket in chunk.buckets:
                self._copy_out(bucket, bucket.shard)
        chunk.gather, chunk.fresh = None, True

    def _copy_out(self, bucket: _Bucket, values: torch.Tensor) -> None:
        rows = values.view(self.dp, bucket.region)
        for slot in bucket.slots:
            p = slot.param
            flat = rows[:, slot.offset : slot.offset + slot.piece].reshape(-1)
            p.copy_(flat[: p.numel()].view_as(p))
