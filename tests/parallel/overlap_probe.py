"""Record, in one rank, the order of collective issues, collective waits and GEMMs.

Overlap means compute runs while a collective is in flight, i.e. between the call that issues
it and the `wait()` that needs its result. That is a fact about order, not about time, so it
can be checked without timing flakiness: every collective the parallel code issues is wrapped
(its `Work` records when it is waited for), every matrix multiply is seen by a dispatch mode
(forward and backward alike), and a collective "has compute in its window" when a GEMM was
recorded between its issue and its wait. A collective never waited for (a send dropped once
completed) has an open window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import megascale.parallel.expert as expert
import megascale.parallel.tp_comm as tp_comm
import megascale.parallel.zero as zero

GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


@dataclass
class Collective:
    name: str
    dtype: torch.dtype
    issued: int  # index in the event stream
    step: int
    waited: int | None = None  # None: never waited for
    backward: bool = False  # issued with grad mode off: by the autograd engine (in a training step)


@dataclass
class Recorder:
    events: int = 0
    step: int = 0
    gemms: list[tuple[int, torch.dtype]] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)  # step starts

    def tick(self) -> int:
        self.events += 1
        return self.events

    def mark_step(self) -> None:
        self.step += 1
        self.marks.append(self.tick())

    def overlapped(self, c: Collective) -> bool:
        """A GEMM ran while `c` was in flight."""
        end = self.events + 1 if c.waited is None else c.waited
        return any(c.issued < i < end for i, _ in self.gemms)

    def spans_a_step_start(self, c: Collective) -> bool:
        end = self.events + 1 if c.waited is None else c.waited
        return any(c.issued < i < end for i in self.marks)

    def of(self, prefix: str, first_step: int = 1) -> list[Collective]:
        return [c for c in self.collectives if c.name.startswith(prefix) and c.step >= first_step]


class _Work:
    """A `dist.Work` that tells the recorder when it is waited for."""

    def __init__(self, work: dist.Work, record: Collective, recorder: Recorder) -> None:
        self._work, self._record, self._recorder = work, record, recorder

    def wait(self, *args, **kwargs):
        if self._record.waited is None:
            self._record.waited = self._recorder.tick()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _wrapped(fn: Callable, name: str, recorder: Recorder, tensor_arg: int) -> Callable:
    def call(*args, **kwargs):
        tensor = args[tensor_arg] if len(args) > tensor_arg else next(iter(kwargs.values()))
        record = Collective(name, tensor.dtype, recorder.tick(), recorder.step, backward=not torch.is_grad_enabled())
        recorder.collectives.append(record)
        work = fn(*args, **kwargs)
        if work is None:  # synchronous: waited for as soon as issued
            record.waited = recorder.tick()
            return None
        return _Work(work, record, recorder)

    return call


class _Gemms(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.recorder.gemms.append((self.recorder.tick(), args[-1].dtype))
        return func(*args, **(kwargs or {}))


def install(monkeypatch_setattr: Callable[[object, str, object], None], recorder: Recorder) -> _Gemms:
    """Wrap the collectives the parallel code issues; return the GEMM-recording mode to enter.

    `monkeypatch_setattr(obj, name, value)` installs a wrapper (a pytest monkeypatch, or a
    plain setattr in a spawned rank)."""
    for module, prefix in ((tp_comm, "tp"), (zero, "dp")):
        monkeypatch_setattr(
            module, "all_gather_single", _wrapped(module.all_gather_single, f"{prefix}.all_gather", recorder, 1)
        )
        monkeypatch_setattr(
            module,
            "reduce_scatter_single",
            _wrapped(module.reduce_scatter_single, f"{prefix}.reduce_scatter", recorder, 1),
        )
    monkeypatch_setattr(expert, "all_to_all_single", _wrapped(expert.all_to_all_single, "ep.all_to_all", recorder, 1))
    monkeypatch_setattr(dist, "isend", _wrapped(dist.isend, "pp.send", recorder, 0))
    monkeypatch_setattr(dist, "irecv", _wrapped(dist.irecv, "pp.recv", recorder, 0))
    return _Gemms(recorder)
