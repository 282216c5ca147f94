"""What the running attempt's reports say, kept up to date per report instead of per tick.

The control loop asks every tick whether some rank died, whether every rank lives (the hang
rule only judges a job whose ranks all live) and whether the attempt is complete. Walking every
rank of every node for that, four times a second, is O(ranks) under the driver's lock (20 ms
at 1,536 nodes). Here a heartbeat only marks its node `fresh`; the tick judges the fresh
reports (O(their ranks)) and keeps per-node answers, so the questions cost O(1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megascale.resilience.driver.rules import Finding, abnormal_exits


@dataclass
class AttemptWatch:
    ranks_per_node: int
    steps: int  # the job's last step: a crash in teardown after it loses nothing
    nodes: set[str] = field(default_factory=set)  # the attempt's active nodes
    fresh: set[str] = field(default_factory=set)  # nodes that reported since the last judgment
    unreported: set[str] = field(default_factory=set)  # no report on this attempt yet
    not_alive: set[str] = field(default_factory=set)  # some rank of theirs is not alive
    finished: set[str] = field(default_factory=set)  # every rank of theirs done and ended

    def watch(self, nodes: list[str]) -> None:
        """A new attempt on `nodes`: none has reported on it yet."""
        self.nodes = set(nodes)
        self.fresh, self.unreported, self.not_alive, self.finished = set(), set(nodes), set(), set()

    def judge(self, reports: dict[str, dict[str, Any]], attempt: int) -> list[Finding]:
        """The abnormal exits in the fresh reports of `attempt`. The fresh set is emptied only
        once every report is judged: a judgment that raised sees them again."""
        out = []
        for node in self.fresh:
            report = reports.get(node, {})
            if node not in self.nodes or report.get("attempt") != attempt:
                continue
            ranks = report.get("ranks", [])
            self.unreported.discard(node)
            out += abnormal_exits(node, [r for r in ranks if (r.get("step") or 0) < self.steps])
            alive = all(r.get("alive") for r in ranks)
            (self.not_alive.discard if alive else self.not_alive.add)(node)
            done = len(ranks) >= self.ranks_per_node and not any(
                r.get("alive") or (r.get("step") or 0) < self.steps for r in ranks
            )
            (self.finished.add if done else self.finished.discard)(node)
        self.fresh = set()
        return out

    @property
    def all_alive(self) -> bool:
        return not self.unreported and not self.not_alive

    @property
    def complete(self) -> bool:
        return bool(self.nodes) and len(self.finished) >= len(self.nodes)
