"""Whether a node's reported progress is possible, before the driver believes it.

Why: the driver ends the job as COMPLETE when every rank says it is past `train.steps`, resets
its hang clock on each new step and learns step times from what nodes report. A node that
reports step 2^62, a step back, a jump no rank could make, or ranks that are not its own would
end the job early or blind the detectors. So a report of the current attempt is refused (422)
unless, for each of its ranks:

* the rank is one of the ranks this attempt gave the node;
* its step is at most `train.steps`, and no lower than what the rank last reported this attempt;
* it advanced at most `resilience.max_step_rate` steps a second since the rank last advanced
  this attempt (its first report: since the job was created, from step 0, as a restarted driver
  knows nothing else);
* its recent step times name steps no later than its step.

One entry per rank of the attempt (cleared when the attempt changes): bounded by the world size.
"""

from __future__ import annotations

from typing import Any

from megascale.resilience.driver.placement import slot_ranks
from megascale.resilience.driver.state import ACTIVE, JobState, Node


class ProgressCheck:
    def __init__(self, total_steps: int, max_step_rate: float) -> None:
        self.total_steps, self.max_step_rate = total_steps, max_step_rate
        self.attempt: int | None = None
        self.last: dict[int, tuple[int, float]] = {}  # rank -> (step, driver time) of its last report

    def refuse(self, node: Node, body: dict[str, Any], state: JobState, now: float) -> str | None:
        """Why `body` (a heartbeat of `node`) is implausible, or None (then it is remembered)."""
        attempt = body.get("attempt")
        if attempt is None or not body.get("ranks"):
            return None
        if attempt > state.attempt:
            return f"attempt {attempt} has not started (the job is at attempt {state.attempt})"
        if attempt < state.attempt:
            return None  # a report of an ended attempt: the driver ignores its progress
        if self.attempt != attempt:
            self.attempt, self.last = attempt, {}
        own = set(slot_ranks(node.slot, state.ranks_per_node)) if node.role == ACTIVE and node.slot >= 0 else set()
        seen: dict[int, tuple[int, float]] = {}
        for r in body["ranks"]:
            if r["rank"] not in own:
                return f"rank {r['rank']} is not a rank of node {node.node_id} in attempt {attempt}"
            why = self._implausible_step(r, state.created, now)
            if why is not None:
                return why
            step, rank = r.get("step"), r["rank"]
            if step is not None and (rank not in self.last or step > self.last[rank][0]):
                seen[rank] = (step, now)
        self.last.update(seen)
        return None

    def _implausible_step(self, r: dict[str, Any], created: float, now: float) -> str | None:
        rank, step = r["rank"], r.get("step")
        if step is None:
            return None
        if step > self.total_steps:
            return f"rank {rank} at step {step}, beyond train.steps={self.total_steps}"
        before, since = self.last.get(rank, (0, created))
        if step < before:
            return f"rank {rank} at step {step} after step {before} in the same attempt"
        allowed = self.max_step_rate * max(1.0, now - since)
        if step - before > allowed:
            return (
                f"rank {rank} jumped from step {before} to {step} in {now - since:.1f} s (at most "
                f"{allowed:.0f} at resilience.max_step_rate={self.max_step_rate:g} a second)"
            )
        recent = r.get("recent")
        if recent and max(recent)[0] > step:  # max() of the pairs in C: no generator per pair
            return f"rank {rank} reports a step time for a step after its step {step}"
        return None
