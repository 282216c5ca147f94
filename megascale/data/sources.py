"""Where a rank's step batch comes from: its own reads, or the group's shared-memory ring.

Each source is called as `source(step, consumed, stop)` and returns this rank's
[2, micro_batches, micro_batch, seq_len] int32 inputs/labels (or None on middle pipeline
stages); `stop` is set when the loader halts, so that a source waiting on another rank gives up.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from megascale.data.dataset import GlobalOrder
from megascale.data.shm import StepRing


@dataclass(frozen=True)
class Shape:
    """Sequences of one dp rank per step, laid out as micro-batches."""

    micro_batches: int
    micro_batch: int
    seq_len: int

    @property
    def sequences(self) -> int:
        return self.micro_batches * self.micro_batch

    def empty(self, ranks: int = 1) -> np.ndarray:
        """[ranks, 2 (inputs, labels), micro_batches, micro_batch, seq_len] int32."""
        return np.empty((ranks, 2, self.micro_batches, self.micro_batch, self.seq_len), np.int32)


def read_dp_slices(
    order: GlobalOrder, shape: Shape, step: int, consumed: list[int], dp_ranks: list[int], out: np.ndarray
) -> None:
    """Fill `out[i]` with dp rank `dp_ranks[i]`'s sequences of `step`."""
    n = shape.sequences
    for i, r in enumerate(dp_ranks):
        items = order.train_items(step, consumed, r * n, (r + 1) * n)
        order.sequences(items, out[i].reshape(2, n, shape.seq_len))


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
        out = self.shape.empty()
        read_dp_slices(self.order, self.shape, step, consumed, [self.dp_rank], out)
        return out[0]


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
        return slot[self.part].copy()


@dataclass
class RingReader:
    """A group member other than the reader: copies its dp slice out of the ring."""

    ring: StepRing
    index: int  # consumer index in the ring header
    part: int
    timeout: float

    def __call__(self, step: int, consumed: list[int], stop: threading.Event) -> np.ndarray:
        return self.ring.copy(self.index, step, self.part, stop, self.timeout)
