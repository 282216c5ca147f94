"""The per-step hook a rank runs under an executor or a fault test: progress, then injected faults.

Deterministic fault injection is keyed by (rank, step). The trainer knows nothing of it: the
rank's entry point installs `rank_step_hook()` only when an executor asked for progress files
or a test asked for a fault.

`MEGASCALE_FAULT="kill:rank=1:step=6"` makes rank 1 SIGKILL itself after step 6 of restart
attempt 0 (torchft's `fail_at(rank, step)` idea). Several faults are separated by `;`. Kinds:

- `kill` SIGKILL, `stop` SIGSTOP (a hang), `raise` an exception, `exit` exit code 3,
  `term` SIGTERM (a preemption notice that reaches this rank only), `killwriter` SIGKILL to
  the rank's stage-2 checkpoint writer process (the rank trains on), `corrupt` a bit flipped
  in each peer copy the rank holds, once the copy in flight has landed (checkpoint/replica.py);
- `sleep:...:seconds=S` a slow step (the status write is delayed too);
- `throttle:...:stop=S:period=P` an outside process stops the rank for S of every P seconds
  (real SIGSTOP/SIGCONT, a CPU-throttled node) until the rank ends.
- `jitter:...:frac=F` from that step on, after every step the rank sleeps a random 0..2F times
  the step's own compute time inside a compute timer span (counted in the next step's compute):
  realistic noise, +-F of the work around its mean, that the straggler rule must not mistake
  for a slow node.

A fault fires only in its `attempt` (default 0), so the resumed run does not fail again.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from megascale.resilience.common.rankstatus import STATUS_DIR_ENV, StatusWriter

FAULT_ENV = "MEGASCALE_FAULT"
ATTEMPT_ENV = "MEGASCALE_RESTART_ATTEMPT"
KINDS = ("kill", "stop", "raise", "exit", "term", "sleep", "throttle", "killwriter", "corrupt", "jitter")


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault: an ordinary Python error in a rank."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int = 0
    params: dict[str, float] = field(default_factory=dict)


def parse_faults(text: str) -> list[Fault]:
    """`kind:rank=R:step=S[:attempt=A][:key=value...]` items separated by `;`."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"{FAULT_ENV}: unknown fault kind {kind!r} in {item!r}; use one of {KINDS}")
        values: dict[str, float] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"{FAULT_ENV}: {pair!r} in {item!r} must look like key=value")
            values[key] = float(value)
        if "rank" not in values or "step" not in values:
            raise ValueError(f"{FAULT_ENV}: {item!r} needs rank= and step=")
        rank, step = int(values.pop("rank")), int(values.pop("step"))
        faults.append(Fault(kind, rank, step, int(values.pop("attempt", 0)), values))
    return faults


class RankFacts(Protocol):
    """What the hook reads of the rank's trainer (which this package cannot import)."""

    @property
    def start_record(self) -> dict[str, Any]: ...

    @property
    def writer_pid(self) -> int | None: ...

    @property
    def replicas(self) -> Any: ...  # a ReplicaStore (checkpoint/replica.py) with no copy in flight, or None

    @property
    def timers(self) -> Any: ...  # the rank's Timers (diagnostics/timers.py): last_totals per kind


class StepHook:
    """What a rank does after each step: report progress, then fail if a fault is due."""

    def __init__(self, rank: int, env: dict[str, str] | None = None, facts: RankFacts | None = None) -> None:
        env = os.environ if env is None else env
        self.rank, self.facts = rank, facts
        attempt = int(env.get(ATTEMPT_ENV) or 0)
        mine = [f for f in parse_faults(env.get(FAULT_ENV, "")) if f.rank == rank and f.attempt == attempt]
        self.faults = {f.step: f for f in mine if f.kind != "jitter"}
        self.jitter = next((f for f in mine if f.kind == "jitter"), None)
        self.random, self.slept = random.Random(rank), 0.0
        self.status = StatusWriter(rank, env.get(STATUS_DIR_ENV))

    def __call__(self, step: int, step_time: float) -> None:
        fault = self.faults.pop(step, None)
        if fault is not None and fault.kind == "sleep":
            time.sleep(fault.params.get("seconds", 5.0))
            step_time += fault.params.get("seconds", 5.0)
        timers = self.facts.timers if self.facts is not None else None
        totals = timers.last_totals if timers is not None else {}
        compute = totals["compute"] + totals["optimizer"] if totals else None
        self.status.write(step, step_time, self.facts.start_record if self.facts else None, compute)
        if self.jitter is not None and step >= self.jitter.step and compute and timers is not None:
            own = max(compute - self.slept, 0.0)  # the step's work without the last injected sleep
            self.slept = self.random.uniform(0.0, 2 * self.jitter.params.get("frac", 0.2)) * own
            with timers.span("injected_jitter", kind="compute"):
                time.sleep(self.slept)
        if fault is not None and fault.kind != "sleep":
            inject(fault, self.facts)


def inject(fault: Fault, facts: RankFacts | None = None) -> None:
    sys.stderr.write(f"megascale: injecting fault {fault.kind} on rank {fault.rank} after step {fault.step}\n")
    sys.stderr.flush()
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "raise":
        raise InjectedFault(f"injected failure on rank {fault.rank} at step {fault.step}")
    elif fault.kind == "exit":
        os._exit(3)
    elif fault.kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif fault.kind == "killwriter" and facts is not None and facts.writer_pid:
        os.kill(facts.writer_pid, signal.SIGKILL)
    elif fault.kind == "corrupt" and facts is not None and facts.replicas is not None:
        for held in list(facts.replicas.held.values()):  # a bit flips in each peer copy this rank keeps
            if held.data:
                held.data[len(held.data) // 2] ^= 0x01
    elif fault.kind == "throttle":
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megascale.resilience.rank.faults",
                "throttle",
                str(os.getpid()),
                str(fault.params.get("stop", 0.2)),
                str(fault.params.get("period", 0.3)),
            ],
            start_new_session=True,
        )


def throttle(pid: int, stop_s: float, period_s: float) -> None:
    """Stop PID for stop_s of every period_s until it is gone (a CPU-starved node)."""
    try:
        while True:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(max(period_s - stop_s, 0.0))
    except ProcessLookupError:
        return


def rank_step_hook(rank: int, env: dict[str, str] | None = None, facts: RankFacts | None = None) -> StepHook | None:
    """The hook for this rank, or None when no executor and no fault test asked for one."""
    env = os.environ if env is None else env
    return StepHook(rank, env, facts) if env.get(STATUS_DIR_ENV) or env.get(FAULT_ENV) else None


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "throttle":
    throttle(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
