"""Shared-memory segments from stage 1 to stage 2: named per job and rank, locked while in use,
unlinked on exit, and those of dead jobs removed at start.

A segment is `/dev/shm/megascale-ckpt-<run id>-r<rank>-<n>`. Every process that uses it (the
trainer that creates it, the writer that maps it) holds a shared `flock` on it, and the kernel
drops that lock when the process dies, however it dies (a whole-tree SIGKILL included). So a
segment that nobody holds belongs to a dead job: `reap_stale`, run when a trainer starts, takes
an exclusive lock without waiting and unlinks what it gets. A writer whose trainer is gone
unlinks its segment the same way when it exits. Where there is no /dev/shm (not Linux) the
segments are plain POSIX shared memory that only their trainer unlinks. No torch here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

PREFIX = "megascale-ckpt-"
SHM_DIR = Path("/dev/shm")
MIN_AGE_S = 30.0  # younger segments may be between their creation and their creator's lock


def segment_name(run_id: str, rank: int, number: int) -> str:
    return f"{PREFIX}{run_id}-r{rank:05d}-{number}"


class Segment:
    """A named segment, created (the trainer) or attached to (the writer), held while open."""

    def __init__(self, name: str, size: int = 0, create: bool = False):
        self.name = name
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=size)
        if not create:  # the creator unlinks it; Python's tracker must not do it for us
            resource_tracker.unregister(self.shm._name, "shared_memory")
        self._lock = _hold(name)

    @property
    def buf(self) -> memoryview:
        return self.shm.buf

    def close(self, unlink: bool = False) -> None:
        self.shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _open_segment(name: str) -> int | None:
    """A descriptor of /dev/shm/<name> if it is a regular file. Never follows a link and never
    waits: a FIFO (or device) planted under a segment's name would block a plain open forever."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone, no /dev/shm here, or a link (ELOOP)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _hold(name: str) -> int | None:
    fd = _open_segment(name)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def reap(name: str) -> bool:
    """Unlink the segment if no live process holds it; True if it did. Anything under the
    prefix that is not a regular file is not a segment and is left alone."""
    fd = _open_segment(name)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # in use
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / name)
        return True
    finally:
        os.close(fd)


def reap_stale() -> list[str]:
    """Remove the segments of dead jobs (nobody holds them); returns their names."""
    if not SHM_DIR.is_dir():
        return []
    removed = []
    now = time.time()
    for path in SHM_DIR.glob(PREFIX + "*"):
        with contextlib.suppress(FileNotFoundError):
            if now - path.lstat().st_mtime >= MIN_AGE_S and reap(path.name):
                removed.append(path.name)
    return removed
