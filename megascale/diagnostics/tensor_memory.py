"""Peak tensor memory and wall time of a function, on any device (CPU included).

`torch.cuda.max_memory_allocated` exists only on CUDA; the benchmarks and the memory tests of
the kernels (chunked loss, sliding-window attention) need the same figure on CPU. PyTorch's
`MemTracker` follows every tensor allocated while it is active (through a dispatch mode and
weak references to storages), so its peak is the most tensor memory alive at once, counting
only what the function allocated (its inputs and parameters existed before). A view of a tensor
made before counts its whole storage as new, unless that tensor is passed as `external`: those
are tracked from the start and their bytes subtracted (a kernel that slices its inputs, as the
sliding-window attention does, would otherwise be charged for them).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence

import torch
from torch.distributed._tools.mem_tracker import MemTracker


def peak_tensor_bytes(
    fn: Callable[[], object], device: torch.device | str = "cpu", external: Sequence[torch.Tensor] = ()
) -> int:
    """The most bytes of tensors allocated by `fn()` alive at once on `device`, beyond `external`."""
    gc.collect()
    tracker = MemTracker()
    tracker.track_external(*external)
    with tracker:
        before = _total(tracker, "current", device)
        fn()
    gc.collect()
    return _total(tracker, "peak", device) - before


def _total(tracker: MemTracker, kind: str, device: torch.device | str) -> int:
    return int(tracker.get_tracker_snapshot(kind).get(torch.device(device), {}).get("Total", 0))


def wall_seconds(fn: Callable[[], object]) -> float:
    """Wall time of one call (after a collection, so no GC pause lands inside it)."""
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
