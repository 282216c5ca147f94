"""Where a rank's step batch comes from: its own reads, or the group's shared-memory ring.

Each source is called as `source(step, consumed, stop)` and returns this rank's
[2, micro_batches, micro_batch, seq_len] int32 inputs/labels (or None on middle pipeline
stages); `stop` is set when the loader halts, so that a source waiting on another rank gives up.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from megascale.config.shares import BatchShares
from megascale.data.dataset import GlobalOrder
from megascale.data.shm import StepRing


@dataclass(frozen=True)
class Shape:
    """A step's sequences as micro-batches: the job's split of the global batch over dp ranks
    (`BatchShares`: uneven under `resilience.shrink='keep-batch'`). Buffers hold the most
    micro-batches any rank takes; a rank's batch is the first `micro_batches_of(r)` of them."""

    shares: BatchShares
    seq_len: int

    @property
    def micro_batches(self) -> int:
        return self.shares.most

    @property
    def micro_batch(self) -> int:
        return self.shares.micro_batch

    def micro_batches_of(self, dp_rank: int) -> int:
        return self.shares.micro_batches(dp_rank)

    def empty(self, ranks: int = 1) -> np.ndarray:
        """[ranks, 2 (inputs, labels), micro_batches, micro_batch, seq_len] int32."""
        return np.empty((ranks, 2, self.micro_batches, self.micro_batch, self.seq_len), np.int32)

    def part(self, buffer: np.ndarray, dp_rank: int) -> np.ndarray:
        """Rank `dp_rank`'s batch in its buffer `[2, micro_batches, micro_batch, seq_len]` (a view)."""
        return buffer[:, : self.micro_batches_of(dp_rank)]

    def sequences_view(self, buffer: np.ndarray, dp_rank: int) -> np.ndarray:
        """The same part as `[2, sequences, seq_len]`, a view (setting `.shape` refuses to copy)."""
        view = self.part(buffer, dp_rank)
        view.shape = (2, self.shares.sequences(dp_rank), self.seq_len)
        return view

    def read(self, order: GlobalOrder, step: int, consumed: list[int], dp_rank: int, buffer: np.ndarray) -> None:
        """Fill rank `dp_rank`'s part of `buffer` with its sequences of `step`: its run of the
        global batch, which is the same whatever dp is."""
        lo = self.shares.first_sequence(dp_rank)
        items = order.train_items(step, consumed, lo, lo + self.shares.sequences(dp_rank))
        order.sequences(items, self.sequences_view(buffer, dp_rank))


def read_dp_slices(
    order: GlobalOrder, shape: Shape, step: int, consumed: list[int], dp_ranks: list[int], out: np.ndarray
) -> None:
    """Fill `out[i]` with dp rank `dp_ranks[i]`'s sequences of `step`."""
    for i, r in enumerate(dp_ranks):
        shape.read(order, step, consumed, r, out[i])


@dataclass
class OwnReads:
    """This rank reads its own dp slice (data.reader='rank', one process, or no group)."""

    order: GlobalOrder
    shape: Shape
    dp_rank: int
    needs_data: bool

    def __call__(self, step: int, consumed: list[int], stop: threading.Event) -> np.ndarray | None:
        if not self.needs_data:
            return None
        out = self.shape.empty()[0]
        self.shape.read(self.order, step, consumed, self.dp_rank, out)
        return self.shape.part(out, self.dp_rank)


@dataclass
class RingWriter:
    """The group's reader: every dp slice of the group into the ring, its own slice returned."""

    order: GlobalOrder
    shape: Shape
    ring: StepRing
    dp_ranks: list[int]
    part: int  # index of this rank's dp slice
    rank: int
    timeout: float

    def __call__(self, step: int, consumed: list[int], stop: threading.Event) -> np.ndarray:
        slot = self.ring.slot_for_write(step, stop, self.timeout)
        try:
            read_dp_slices(self.order, self.shape, step, consumed, self.dp_ranks, slot)
        except Exception as exc:  # the consumers raise it too, instead of waiting
            self.ring.fail(f"rank {self.rank}: {exc}")
            raise
        self.ring.publish(step)
        return self.shape.part(slot[self.part], self.dp_ranks[self.part]).copy()


@dataclass
class RingReader:
    """A group member other than the reader: copies its dp slice out of the ring."""

    ring: StepRing
    index: int  # consumer index in the ring header
    part: int
    timeout: float
    micro_batches: int  # this rank's (the ring's slots hold the most any rank takes)

    def __call__(self, step: int, consumed: list[int], stop: threading.Event) -> np.ndarray:
        return self.ring.copy(self.index, step, self.part, stop, self.timeout)[:, : self.micro_batches]
