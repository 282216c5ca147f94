"""Which silent nodes are lost: correlated silence is the driver's or the network's, not a node's.

A node whose heartbeats stop while its peers' go on is lost. When most nodes fall silent at
once, the likelier cause is on the driver's side: its process stalled (stopped, swapped,
starved of CPU) or the network between it and the nodes blinked. Evicting then would throw
away healthy nodes and end the job, so the driver suspects itself: it judges no node lost and
no training hung while the silence lasts, logs it, and waits for the heartbeats to come back
(executors keep knocking). When the silence ends, a node still silent is judged from the end
of the episode, a full `heartbeat_timeout_s` later, and the time without any evidence is not
counted against the hang window.

`last_seen` is kept in heartbeat order (each update moves the node to the end), so finding the
silent nodes costs O(silent + 1) per tick, not O(nodes). (A wall clock stepped back can leave a
node out of order: it is then found one heartbeat timeout late, never wrongly.)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

log = logging.getLogger("megascale.driver")
LOG_EVERY_S = 30.0


class LastSeen(OrderedDict):
    """node -> when it was last heard from, oldest first: every assignment moves to the end."""

    def __setitem__(self, node: str, when: float) -> None:
        super().__setitem__(node, when)
        self.move_to_end(node)


@dataclass
class SilenceWatch:
    timeout_s: float
    fraction: float  # the silent share of the watched nodes that is taken for a correlated silence
    last_seen: LastSeen = field(default_factory=LastSeen)
    since: float | None = None  # the current correlated silence began (None: there is none)
    judged_from: float = 0.0  # silences are counted from here (the end of the last episode)
    episodes: int = 0
    _logged: float = 0.0

    def forget(self, node: str) -> None:
        self.last_seen.pop(node, None)

    def silent_for(self, node: str, now: float) -> float:
        return now - max(self.last_seen.get(node, 0.0), self.judged_from)

    def silent(self, now: float) -> list[tuple[str, float]]:
        """(node, last seen) of each node silent past the timeout, oldest first."""
        out = []
        for node, t in self.last_seen.items():
            if now - t <= self.timeout_s:
                break
            out.append((node, t))
        return out

    def quiet(self, now: float) -> int:
        """Nodes not heard from for half the timeout: a healthy node beats several times in that
        while, so many of them at once is one cause, even before each crosses the timeout (their
        last beats were up to a period apart: judging the first to cross alone would evict it)."""
        count = 0
        for t in self.last_seen.values():
            if now - t <= self.timeout_s / 2:
                break
            count += 1
        return count

    def lost(self, now: float) -> tuple[list[tuple[str, float]], float]:
        """The nodes to judge lost now, and the seconds of this tick that had no evidence at all
        (the end of a correlated silence: the hang window moves on by that much)."""
        silent = self.silent(now)
        watched = len(self.last_seen)
        correlated = watched >= 2 and self.quiet(now) >= max(2.0, self.fraction * watched)
        if correlated:
            if self.since is None:
                first = next(iter(self.last_seen.values()))
                self.since, self.episodes, self._logged = first, self.episodes + 1, 0.0
            if now - self._logged >= LOG_EVERY_S:
                log.warning(
                    "%d of %d nodes silent at once for %.1f s: suspecting the driver or the network, "
                    "not the nodes; waiting for their heartbeats (nobody is evicted on this)",
                    len(silent),
                    watched,
                    now - self.since,
                )
                self._logged = now
            return [], 0.0
        gap = 0.0
        if self.since is not None:
            gap, self.since, self.judged_from = now - self.since, None, now
            log.warning(
                "heartbeats are back from %d of %d nodes after a silence of %.1f s; a node "
                "still silent is judged from now",
                watched - len(silent),
                watched,
                gap,
            )
        return [(n, t) for n, t in silent if now - max(t, self.judged_from) > self.timeout_s], gap

    @property
    def correlated(self) -> bool:
        return self.since is not None
