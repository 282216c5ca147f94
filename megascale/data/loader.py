"""The trainer's view of the data: one `TokenBatch` per optimizer step, prepared ahead.

`TrainLoader` pulls step batches from a source (`sources.py`: this rank reading the shards
itself, the node's reader writing to shared memory, or a copy out of shared memory) and, with
`data.prefetch`, runs that source one step ahead in a background thread, so the batch for step
k+1 is ready when step k ends. `wait_seconds` is what the trainer records as data wait.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from megascale.data.dataset import GlobalOrder
from megascale.data.shards import DataError
from megascale.data.sources import Shape


@dataclass
class TokenBatch:
    inputs: torch.Tensor  # int64 [micro_batches, micro_batch, seq_len]
    labels: torch.Tensor  # same shape; -100 where no loss


def to_batch(pair: np.ndarray) -> TokenBatch:
    """[2, M, B, L] int32 -> TokenBatch of int64 tensors (a copy, owned by the caller)."""
    return TokenBatch(torch.from_numpy(pair[0].astype(np.int64)), torch.from_numpy(pair[1].astype(np.int64)))


# source(step, consumed, stop) -> [2, M, B, L] int32 for this rank, or None (see sources.py)
Source = Callable[[int, list[int], threading.Event], "np.ndarray | None"]


class TrainLoader:
    """Step batches for this rank, in order, resumable; optionally one step ahead."""

    def __init__(
        self,
        order: GlobalOrder,
        produce: Source,
        prefetch: bool,
        fingerprint: str,
        on_close: Callable[[], None] | None = None,
    ):
        self.order, self._produce, self.prefetch = order, produce, prefetch
        self.fingerprint = fingerprint
        self._on_close = on_close
        self.wait_seconds = 0.0
        self.reader_group = None  # set by build_loaders: the ranks sharing this rank's reader
        self._step = 0
        self._consumed = [0] * len(order.splits)
        self._thread: threading.Thread | None = None
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._credit = threading.Lock()  # released by each next_batch: prepare one more
        self._stop = threading.Event()
        if prefetch:
            self._start()

    # -- the trainer's interface ------------------------------------------------------------
    def next_batch(self) -> TokenBatch | None:
        start = time.perf_counter()
        if self._thread is not None:
            step, batch, error = self._ready.get()
            if error is not None:
                raise error
            assert step == self._step, (step, self._step)
        else:
            batch = self._batch(self._step, self._consumed)
        self._consumed = self.order.advance(self._step, self._consumed)
        self._step += 1
        self.wait_seconds = time.perf_counter() - start
        if self._thread is not None:
            # Last: the woken thread may take the GIL at once; it then runs during the step.
            self._credit.release()
        return batch

    @property
    def position(self) -> int:
        """Batches handed out so far: the next batch's position in the data order."""
        return self._step

    def state_dict(self) -> dict:
        return {"step": self._step, "consumed": ",".join(map(str, self._consumed)), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise DataError(
                "the checkpoint's data loader state belongs to other data or order "
                f"({state.get('fingerprint')!r}); this job reads {self.fingerprint!r}"
            )
        consumed = [int(c) for c in str(state["consumed"]).split(",")]
        self._halt()
        self._step, self._consumed = int(state["step"]), consumed
        if self.prefetch:
            self._start()

    def close(self) -> None:
        self._halt()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    # -- background preparation ------------------------------------------------------------
    def _start(self) -> None:
        self._stop.clear()
        self._ready, self._credit = queue.SimpleQueue(), threading.Lock()
        self._credit.acquire()
        self._thread = threading.Thread(
            target=self._run, args=(self._step, list(self._consumed)), name="megascale-data-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, step: int, consumed: list[int]) -> None:
        """Prepare the batch of `step`, hand it over, wait until it is taken, go on with the next:
        one batch ahead. C-level primitives only (SimpleQueue, Lock), so that taking a ready
        batch never wakes this thread while the trainer's thread still holds the GIL."""
        while not self._stop.is_set():
            try:
                self._ready.put((step, self._batch(step, consumed), None))
            except BaseException as exc:  # handed to the trainer's thread
                self._ready.put((step, None, exc))
                return
            while not self._credit.acquire(timeout=0.1):
                if self._stop.is_set():
                    return
            consumed = self.order.advance(step, consumed)
            step += 1

    def _batch(self, step: int, consumed: list[int]) -> TokenBatch | None:
        pair = self._produce(step, consumed, self._stop)
        return None if pair is None else to_batch(pair)

    def _halt(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None


class EvalLoader:
    """The same held-out batches on every call (read once, then kept)."""

    def __init__(self, order: GlobalOrder, shape: Shape, dp_rank: int, batches: int, needs_data: bool):
        self.order, self.shape, self.dp_rank = order, shape, dp_rank
        self.count = batches if order.val_windows else 0
        self.needs_data = needs_data
        self._cache: list[np.ndarray] | None = None

    def batches(self) -> Iterator[TokenBatch | None]:
        if not self.needs_data:
            yield from (None for _ in range(self.count))
            return
        if self._cache is None:
            self._cache = [self._read(b) for b in range(self.count)]
        for pair in self._cache:
            yield to_batch(pair)

    def _read(self, batch: int) -> np.ndarray:
        """This rank's share of held-out batch `batch`, split over dp as the training batch is."""
        shares, out = self.shape.shares, self.shape.empty()[0]
        lo = shares.first_sequence(self.dp_rank)
        items = self.order.val_items(batch, lo, lo + shares.sequences(self.dp_rank))
        self.order.sequences(items, self.shape.sequences_view(out, self.dp_rank))
        return self.shape.part(out, self.dp_rank)
