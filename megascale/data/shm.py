"""A ring of step batches in POSIX shared memory: one writer (the reader rank), local readers.

Layout: an int64 header, then `slots` batches of [dp ranks, 2, micro_batches, micro_batch,
seq_len] int32. The header holds the writer's pid, an error/closed state, each slot's step
(a seqlock: -1 while being written) and each consumer's next wanted step (back-pressure, and
its pid so that a dead consumer is noticed). No lock is shared: every word has one writer.

The segment's name is unlinked as soon as every local rank has mapped it, so nothing is left
in /dev/shm whichever process dies later (the mapping lives as long as some process holds it).
Between creation and unlink, the writer's multiprocessing resource tracker removes it if the
writer is killed.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import mmap
import os
import secrets
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import psutil

from megascale.data.shards import DataError

PREFIX = "megascale-data-"
MAGIC = 0x6D73_6461_7461  # "msdata"
_MAGIC, _WRITER_PID, _STATE, _SLOTS, _CONSUMERS, _FIXED = range(6)
OK, FAILED, CLOSED = 0, 1, 2
ERROR_BYTES = 1024
LIVENESS_EVERY_S = 0.25


class Interrupted(Exception):
    """The wait was cancelled by the caller (the loader is stopping or seeking)."""


class StepRing:
    """Shared step batches for one reader group on one host."""

    def __init__(
        self,
        name: str,
        buf: memoryview | mmap.mmap,
        slot_shape: tuple[int, ...],
        slots: int,
        consumers: int,
        owner: shared_memory.SharedMemory | None,
    ):
        self.name, self._buf, self._owner = name, buf, owner
        self.slots, self.consumers = slots, consumers
        self.header_len = _FIXED + slots + 2 * consumers
        self.header = np.ndarray((self.header_len,), np.int64, buf)
        offset = self.header_len * 8 + ERROR_BYTES
        self.error_buf = np.ndarray((ERROR_BYTES,), np.uint8, buf, self.header_len * 8)
        self.data = np.ndarray((slots, *slot_shape), np.int32, buf, offset)
        self.slot_step = self.header[_FIXED : _FIXED + slots]
        self.wanted = self.header[_FIXED + slots : _FIXED + slots + consumers]
        self.pids = self.header[_FIXED + slots + consumers :]

    # -- creation, attachment, release --------------------------------------------------------
    @staticmethod
    def nbytes(slot_shape: tuple[int, ...], slots: int, consumers: int) -> int:
        return (_FIXED + slots + 2 * consumers) * 8 + ERROR_BYTES + slots * 4 * int(np.prod(slot_shape))

    @classmethod
    def create(cls, slot_shape: tuple[int, ...], slots: int, consumers: int) -> StepRing:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name, create=True, size=cls.nbytes(slot_shape, slots, consumers))
        ring = cls(name, shm.buf, slot_shape, slots, consumers, owner=shm)
        ring.header[:] = 0
        ring.header[_MAGIC], ring.header[_WRITER_PID] = MAGIC, os.getpid()
        ring.header[_SLOTS], ring.header[_CONSUMERS] = slots, consumers
        ring.slot_step[:] = -1
        return ring

    @classmethod
    def attach(cls, name: str, slot_shape: tuple[int, ...], slots: int, consumers: int, index: int) -> StepRing:
        # Mapped directly, not through SharedMemory, which would register the segment with a
        # resource tracker (shared by spawned processes) that must only know its creator.
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            buf = mmap.mmap(fd, cls.nbytes(slot_shape, slots, consumers))
        finally:
            os.close(fd)
        ring = cls(name, buf, slot_shape, slots, consumers, owner=None)
        if ring.header[_MAGIC] != MAGIC or ring.header[_SLOTS] != slots:
            raise DataError(f"shared memory {name} does not hold a megascale step ring")
        ring.pids[index] = os.getpid()
        return ring

    def unlink(self) -> None:
        """Remove the name (all local ranks have mapped it); the memory lives on."""
        if self._owner is not None:
            with contextlib.suppress(FileNotFoundError):  # already unlinked after attach
                self._owner.unlink()

    def fail(self, message: str) -> None:
        """The writer cannot go on: consumers raise this message instead of waiting."""
        raw = message.encode()[: ERROR_BYTES - 1]
        self.error_buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        self.error_buf[len(raw)] = 0
        self.header[_STATE] = FAILED

    def close(self) -> None:
        """Release the mapping; the writer first tells consumers that it stopped."""
        if self.header is None:
            return
        if self._owner is not None:
            if self.header[_STATE] == OK:
                self.header[_STATE] = CLOSED
            self.unlink()
        self.header = self.error_buf = self.data = self.slot_step = None  # type: ignore[assignment]
        self.wanted = self.pids = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still alive: the OS frees it at exit
            if self._owner is not None:
                self._owner.close()
            else:
                self._buf.close()

    # -- the writer -----------------------------------------------------------------------------
    def slot_for_write(self, step: int, stop: threading.Event, timeout: float) -> np.ndarray:
        """The slot for `step`, once no consumer still needs the step it holds."""
        j = step % self.slots
        held = int(self.slot_step[j])

        def free() -> bool:
            return held < 0 or held >= step or bool((self.wanted > held).all())

        self._wait(free, stop, timeout, self._check_consumers, f"consumers to take step {held}")
        self.slot_step[j] = -1  # seqlock: being written
        return self.data[j]

    def publish(self, step: int) -> None:
        self.slot_step[step % self.slots] = step

    # -- a consumer -----------------------------------------------------------------------------
    def seek(self, index: int, step: int) -> None:
        self.wanted[index] = step

    def copy(self, index: int, step: int, part: int, stop: threading.Event, timeout: float) -> np.ndarray:
        """Copy part `part` (this rank's dp slice) of `step` out of the ring."""
        j = step % self.slots
        self.wanted[index] = step
        while True:
            self._wait(
                lambda: self.slot_step[j] == step,
                stop,
                timeout,
                self._check_writer,
                f"the reader to publish step {step}",
            )
            out = self.data[j, part].copy()
            if self.slot_step[j] == step:  # not rewritten while copying
                self.wanted[index] = step + 1
                return out

    # -- waiting ---------------------------------------------------------------------------------
    def _wait(self, ready, stop: threading.Event, timeout: float, check, what: str) -> None:
        start = last = time.monotonic()
        pause = 2e-5
        while not ready():
            if stop.is_set():
                raise Interrupted
            now = time.monotonic()
            if now - last > LIVENESS_EVERY_S:
                check()
                last = now
            if now - start > timeout:
                raise DataError(f"timed out after {timeout:.0f} s waiting for {what} (shared memory {self.name})")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _check_writer(self) -> None:
        state = int(self.header[_STATE])
        if state == FAILED:
            raw = bytes(self.error_buf).split(b"\0", 1)[0].decode(errors="replace")
            raise DataError(f"the node's data reader failed: {raw}")
        if state == CLOSED:
            raise DataError("the node's data reader closed its loader while this rank still reads")
        pid = int(self.header[_WRITER_PID])
        if not _alive(pid):
            raise DataError(f"the node's data reader (pid {pid}) died; this rank cannot get data")

    def _check_consumers(self) -> None:
        for pid in self.pids:
            if pid and not _alive(int(pid)):
                raise DataError(f"a local rank reading shared batches (pid {pid}) died")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
