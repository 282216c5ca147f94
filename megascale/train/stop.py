"""Stop on SIGTERM or Ctrl-C at a step boundary that every rank agrees on, so the job can save.

Schedulers preempt with SIGTERM and a grace period (Slurm's KillWait, Kubernetes'
terminationGracePeriodSeconds; torchrun forwards it to every rank). The signal reaches ranks
at different moments -- some inside a collective, some between steps -- and may reach only
some of them, so the handler only records it; after each step all ranks take the max of
their flags (one tiny all-reduce), and either all stop at that step or none does. A second
signal (more than REPEAT_WINDOW_S later) means "now": the default action runs at once and
nothing is saved.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger("megascale")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 2.0  # a repeat within this is the same request arriving by two routes


class StopOnSignal:
    """Context manager installing the handlers (main thread only); `agreed()` after each step."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None  # the first signal this rank caught
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        if self.enabled:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if time.monotonic() - self._first_at < REPEAT_WINDOW_S:
                return  # one event delivered twice (the terminal and torchrun both pass on Ctrl-C)
            self._restore()  # a second request: act as if we had never caught it
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.received, self._first_at = signum, time.monotonic()
        log.warning(
            "%s received: stopping after this step and saving a checkpoint "
            "(send it again to stop at once, without saving)",
            signal.Signals(signum).name,
        )

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, device: torch.device) -> int:
        """The signal any rank received (the highest number if several), the same on every
        rank, else 0. A collective over all ranks: call it at the same point of every step."""
        if not self.enabled:
            return 0
        flag = torch.tensor(self.received or 0, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)
