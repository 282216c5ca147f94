"""What the trainer does about bad numbers: non-finite gradients and loss spikes.

Both decisions are made on values every rank already holds alike (the global gradient norm,
summed over every group for clipping, and the global loss), so every rank takes the same
branch without a collective of its own. A skipped step consumes its batch but not a step
number: the learning-rate schedule and the checkpoint cadence go on as if the batch had not
been there, so a run that skips a batch ends like a run that never had it.

- `NonFiniteGuard`: a non-finite norm skips the optimizer step; only then does each rank look
  at its own gradients and the ranks gather which parameters were bad (the rare path may
  communicate); too many in a row stop the run with `TrainingHalted`.
- `SpikeDetector`: a loss above median + threshold x 1.4826 MAD of the last `window` good
  losses (the MAD scale floored at 1% of the median, so a flat curve does not turn noise into
  spikes) is a spike; the trainer logs it, skips the step, or rolls back (`DataSkips` then
  drops the batches that caused it when the restored loader reaches them again).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("megascale")

MAD_SCALE = 1.4826  # MAD -> standard deviation for normally distributed values
SCALE_FLOOR = 0.01  # of the median: the smallest deviation unit


class TrainingHalted(RuntimeError):
    """Training cannot usefully go on; the message says why and where to resume from."""


@dataclass(frozen=True)
class Spike:
    loss: float
    median: float
    scale: float  # robust deviation unit the threshold multiplies

    def describe(self) -> str:
        return (
            f"loss {self.loss:.4f} is {(self.loss - self.median) / self.scale:.1f} robust deviations above the "
            f"median {self.median:.4f} of the last losses"
        )


class SpikeDetector:
    """Robust z-score of the global loss against a window of recent good steps' losses."""

    def __init__(self, window: int, threshold: float):
        self.threshold = threshold
        self._losses: deque[tuple[int, float]] = deque(maxlen=window)

    def check(self, loss: float) -> Spike | None:
        """A spike, or None (also while the window is not yet full)."""
        if len(self._losses) < self._losses.maxlen:
            return None
        values = [v for _, v in self._losses]
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        scale = max(MAD_SCALE * mad, SCALE_FLOOR * abs(median), 1e-12)
        return Spike(loss, median, scale) if loss > median + self.threshold * scale else None

    def add(self, step: int, loss: float) -> None:
        self._losses.append((step, loss))

    def forget_after(self, step: int) -> None:
        """A rollback to `step`: the losses of later steps will be seen again."""
        kept = [(s, v) for s, v in self._losses if s <= step]
        self._losses.clear()
        self._losses.extend(kept)


class DataSkips:
    """Loader positions whose batches a rollback decided never to train on."""

    def __init__(self) -> None:
        self.windows: list[tuple[int, int]] = []  # [first, last] loader positions

    def add(self, first: int, last: int) -> None:
        self.windows.append((first, last))

    def skips(self, position: int) -> bool:
        return any(first <= position <= last for first, last in self.windows)


class NonFiniteGuard:
    """Counts optimizer steps skipped for a non-finite gradient norm; halts after too many."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    def ok(self) -> None:
        self.consecutive = 0

    def skipped(self, step: int, norm: float, origin: list[dict], last_good: str) -> None:
        """Log the skipped step (rank 0 names where the non-finite values were); raise
        `TrainingHalted` after `max_consecutive` in a row."""
        self.consecutive += 1
        self.total += 1
        where = (
            "; ".join(
                f"rank {o['rank']} (pp {o['pp']} dp {o['dp']} tp {o['tp']}): "
                f"{', '.join(o['params'][:4])}{' ...' if len(o['params']) > 4 else ''}"
                for o in origin
            )
            or "no gradient of the optimizer's tensors (the norm's sum overflowed)"
        )
        log.warning(
            "step %d: gradient norm is %s: optimizer step skipped on every rank (%d in a row, %d in this "
            "run); non-finite gradients, earliest in the backward first: %s",
            step,
            norm,
            self.consecutive,
            self.total,
            where,
        )
        if self.consecutive >= self.max_consecutive:
            raise TrainingHalted(
                f"{self.consecutive} consecutive steps (up to step {step}) had a non-finite gradient norm "
                f"(train.max_skipped_steps={self.max_consecutive}), first seen in {where}; nothing non-finite "
                f"reached the parameters or a checkpoint; the last good checkpoint is {last_good}. Lower "
                "optim.lr, check the data, or raise train.max_skipped_steps"
            )


def nonfinite_origin(
    named: list[tuple[str, torch.Tensor]], coords: dict[str, int], rank: int, world: int
) -> list[dict]:
    """Every rank's optimizer tensors whose gradient holds inf/nan, gathered on every rank;
    ranks ordered as the backward runs (last stage first), parameters too (last first)."""
    flags = torch._foreach_norm([t.grad for _, t in named if t.grad is not None]) if named else []
    with_grad = [n for n, t in named if t.grad is not None]
    bad = [n for n, norm in zip(with_grad, flags, strict=True) if not torch.isfinite(norm)]
    mine = {"rank": rank, **coords, "params": bad[::-1]}
    every = [mine]
    if world > 1 and dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, mine)
    return sorted((o for o in every if o["params"]), key=lambda o: (-o["pp"], o["dp"], o["tp"]))
