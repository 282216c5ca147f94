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


def _shared(numel: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> list[torch.Tensor]:
    """`numel`-element buffers of each dtype over one allocation: the reduce-scatter input and
    the all-gather output of a bucket are never in use at once (a chunk's gather is waited for
    before its first forward, its reduce-scatter starts after its last backward)."""
    size = max(torch.empty((), dtype=d).element_size() for d in dtypes)
    raw = torch.zeros(numel * size, dtype=torch.uint8, device=device)
    return [raw.view(d)[:numel] for d in dtypes]


@dataclass
class _Slot:
    """One parameter inside a bucket."""

    name: str
    param: nn.Parameter
    piece: int  # elements per rank (padded numel / dp)
    offset: int  # where its piece starts inside a rank's region
    shard: torch.Tensor | None = None  # fp32 view of the bucket's shard region
    hook_calls: int = 0


@dataclass
class _Bucket:
    slots: list[_Slot]
    region: int  # elements per rank
    shard: torch.Tensor  # [region] fp32 master values (the optimizer steps on views of it)
    grad: torch.Tensor  # [region] fp32 dp-summed gradients
    send: torch.Tensor  # [dp * region] reduce-scatter input in the reduce dtype (dp = 1: grad)
    recv: torch.Tensor  # [region] reduce-scatter output in the reduce dtype (grad when fp32)
    gathered: torch.Tensor  # [dp * region] all-gather output in the parameters' dtype (shares send's memory)
    low: torch.Tensor  # [region] all-gather input: the masters in the parameters' dtype (shard when fp32)
    ready: int = 0  # slots whose gradient is final this step
    work: dist.Work | None = None
    launched: bool = False


@dataclass
class _Chunk:
    buckets: list[_Bucket]
    fresh: bool = True  # parameters hold the latest shards
    aliased: bool = False  # dp = 1 and fp32: the parameters are their masters, always fresh
    gather: list[dist.Work] | None = None  # in-flight all-gather
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
        param_dtype = slots[0].param.dtype  # parameters are gathered in their dtype
        shard = torch.zeros(region, dtype=torch.float32, device=device)
        grad = torch.zeros(region, dtype=torch.float32, device=device)
        if self.dp == 1:  # no collective: gradients go straight into fp32, masters into the parameters
            send, recv, gathered, low = grad, grad, shard, shard
        else:
            send, gathered = _shared(self.dp * region, (self.reduce_dtype, param_dtype), device)
            recv = grad if self.reduce_dtype == torch.float32 else torch.zeros_like(grad, dtype=self.reduce_dtype)
            low = shard if param_dtype == torch.float32 else torch.zeros_like(shard, dtype=param_dtype)
        bucket = _Bucket(slots, region, shard, grad, send, recv, gathered, low)
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
        timers = get_timers()
        for chunk in self._chunks:
            for bucket in chunk.buckets:
                if not bucket.launched and self.dp == 1:
                    self._launch_reduce_scatter(bucket)  # a copy into fp32, no collective
                elif not bucket.launched:
                    with timers.span("dp.reduce_scatter", kind="comm", op="reduce_scatter", group="dp"):
                        self._launch_reduce_scatter(bucket)
                if bucket.work is not None:
                    with timers.span("dp.reduce_scatter", kind="comm", op="reduce_scatter", group="dp"):
                        bucket.work.wait()
                if bucket.recv is not bucket.grad:
                    bucket.grad.copy_(bucket.recv)  # the fp32 shard gradient the optimizer reads
                bucket.work, bucket.launched, bucket.ready = None, False, 0
                for slot in bucket.slots:
                    slot.shard.grad = bucket.grad[slot.offset : slot.offset + slot.piece].view_as(slot.shard)
                    slot.hook_calls = 0

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
        for _, shard in self._named:
            shard.grad = None

    def wait_params(self) -> None:
        """Make every chunk's parameters current (before evaluation or saving the model)."""
        for index in range(len(self._chunks)):
            self._wait_gather(index)

    # ------------------------------------------------------------------ reduce-scatter
    def _grad_ready(self, bucket: _Bucket, slot: _Slot) -> None:
        """Post-accumulate-grad hook: launch the bucket once its last gradient is final."""
        if bucket.launched:
            raise RuntimeError(
                f"ZeRO: gradient of {slot.name} accumulated after its bucket was reduce-scattered "
                f"(more than {self.expected_backwards} backward passes per step?)"
            )
        slot.hook_calls += 1
        if slot.hook_calls == self.expected_backwards:
            bucket.ready += 1
            if bucket.ready == len(bucket.slots):
                self._launch_reduce_scatter(bucket)

    @torch.no_grad()
    def _launch_reduce_scatter(self, bucket: _Bucket) -> None:
        if bucket.launched:
            return
        rows = bucket.send.view(self.dp, bucket.region)
        for slot in bucket.slots:
            dest = rows[:, slot.offset : slot.offset + slot.piece]
            grad = slot.param.grad
            if grad is None:  # unused this step: contributes zero
                dest.zero_()
                continue
            dest.copy_(self._pieces(grad.reshape(-1), slot.piece))
            slot.param.grad = None  # ZeRO-2: only the shard's gradient outlives the step
        bucket.launched = True
        if self.dp > 1:
            bucket.work = reduce_scatter_single(bucket.recv, bucket.send, group=self.group, async_op=self.overlap)

    # ------------------------------------------------------------------ all-gather
    def _start_gather(self, index: int) -> None:
        chunk = self._chunks[index]
        if chunk.fresh or chunk.gather is not None:
            return
        works = []
        for bucket in chunk.buckets:
            if self.dp == 1:
                continue  # the masters are rounded into the parameters when waited for
            if bucket.low is not bucket.shard:
                bucket.low.copy_(bucket.shard)  # the updated master values, rounded once
            works.append(all_gather_single(bucket.gathered, bucket.low, group=self.group, async_op=True))
        chunk.gather = works

    @torch.no_grad()
    def _wait_gather(self, index: int) -> None:
        chunk = self._chunks[index]
        if chunk.fresh:
            return
        self._start_gather(index)
        if chunk.gather:
            with get_timers().span("dp.all_gather", kind="comm", op="all_gather", group="dp"):
                for work in chunk.gather:
                    work.wait()
        for bucket in chunk.buckets:
            rows = bucket.gathered.view(self.dp, bucket.region)
            for slot in bucket.slots:
                p = slot.param
                values = rows[:, slot.offset : slot.offset + slot.piece].reshape(-1)
                p.copy_(values[: p.numel()].view_as(p))
        chunk.gather, chunk.fresh = None, True
