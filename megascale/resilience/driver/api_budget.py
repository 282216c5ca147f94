"""Per-caller budgets for the driver API: one caller's flood costs that caller, not the others.

Why: the handlers' queue and the driver's CPU are shared. A node holding its own credential
that pipelines maximum-size heartbeats over a hundred connections froze the driver (two answered
heartbeats of the victim node in 14 s, the operator's handshake timed out); a queue filled by one
caller would answer every other caller 503. So each caller has a token bucket charged per
request by its size (1 unit + 1 per 16 KiB of body) and a cap on its requests queued at once;
past either it gets a 429 with Retry-After before its body is read, and the connection closes.

A caller is its node id for a node credential (local mode and NAT put many nodes behind one
address, and the credential is the better key), else its address with its role (join token,
operator). Every node registers with the join token, and the whole roster may do so at once
through one address (local mode: 256 simulated nodes at once were answered 429 and retried, and
the driver's CPU per registration rose 3-9x: 4.1 and 11.0 ms at 32 and 256 nodes, 1.25 and 1.09
ms with the roster's budget), so the join token at one address gets the budget of `per_address`
callers (the launcher sets the job's node count; an operator's budget stays one's). Requests
without a valid credential never reach the handlers (a 401 from the event loop); what they cost
is a TLS handshake each, and connections that have not shown a credential are shed from the
address holding the most of them (`api_server.py`). Addresses are not blocked at accept: many
legitimate clients share one (loopback in local mode, NAT), and a local user's flood of wrong
tokens would then lock the node's executors out. The buckets are bounded in number (least
recently used dropped), as every piece of driver state is.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from megascale.resilience.driver.identity import JOIN, NODE, Principal


@dataclass(frozen=True)
class Budget:
    rate: float = 32.0  # units a second per caller: a node of 8 ranks sends ~3 a second (5 beats in recovery)
    burst: float = 160.0  # a full bucket: one maximum-size (2 MiB) body, or a burst of small requests
    unit_bytes: int = 16 << 10
    max_pending: int = 8  # a caller's requests queued for the handlers at once
    max_callers: int = 1 << 16  # buckets kept; the least recently used beyond are dropped
    per_address: int = 1  # nodes that may share one address-keyed caller: its budget is this many times


def caller_key(who: Principal, ip: str) -> str:
    """Whom a request is charged to (see the module docstring); `CallerBudgets._share` reads the
    key's role."""
    return f"node {who.node}" if who.role == NODE else f"{who.role} at {ip}"


class CallerBudgets:
    def __init__(self, budget: Budget | None = None) -> None:
        self.budget = budget or Budget()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, when)
        self.pending: Counter[str] = Counter()
        self.refused = 0

    def cost(self, length: int) -> float:
        return 1.0 + length / self.budget.unit_bytes

    def take(self, key: str, cost: float, now: float) -> float:
        """Charge `cost` to `key`: 0.0 when granted, else the seconds until it would be."""
        share = self._share(key)
        tokens = self._tokens(key, now, share)
        if tokens >= cost:
            self._buckets[key] = (tokens - cost, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        self.refused += 1
        return (min(cost, self.budget.burst * share) - tokens) / (self.budget.rate * share)

    def queue(self, key: str) -> bool:
        """Count one more queued request of `key`; False (nothing counted) at its cap."""
        if self.pending[key] >= self.budget.max_pending * self._share(key):
            self.refused += 1
            return False
        self.pending[key] += 1
        return True

    def done(self, key: str) -> None:
        self.pending[key] -= 1
        if self.pending[key] <= 0:
            del self.pending[key]

    def _share(self, key: str) -> int:
        """How many callers' budget `key` has: `per_address` for the join token at an address (a
        whole roster's registrations), one for a node or an operator."""
        return max(1, self.budget.per_address) if key.startswith(f"{JOIN} at ") else 1

    def _tokens(self, key: str, now: float, share: int) -> float:
        b = self.budget
        tokens, when = self._buckets.pop(key, (b.burst * share, now))
        self._buckets[key] = (tokens, when)  # most recently used last
        if len(self._buckets) > b.max_callers:
            self._buckets.popitem(last=False)
        return min(b.burst * share, tokens + (now - when) * b.rate * share)
