"""Whom a fault is blamed on: the first rank to die, not the first report.

When one rank dies, its peers die moments later: gloo or NCCL sees the connection close and
raises (or NCCL's watchdog aborts the process). Their nodes may report first and their
tracebacks match the error keywords, so the first finding the driver sees is often a peer's.
So the finding with the earliest event is blamed: a rank's exit time, as its executor saw it
(a thread waits on each rank), or for an error line the time of the report that carried it; a
death by a signal wins a tie, and findings without a time (a hang) come last. A rank that then
exits with an error (a non-zero code, or SIGABRT as NCCL's watchdog uses), or logs one, is
collateral: listed with the fault, never blamed, never counted toward
`resilience.max_node_faults`. Any other later finding (a second rank killed by a signal) is
listed as "also". Evidence comes from every node's heartbeats, so no verdict is given until
each node has reported after the earliest event, or until the caller says the wait is over.
Pure logic over the executors' reports: no I/O, no clock.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from typing import Any

from megascale.resilience.driver.rules import Finding

RANK_FINDINGS = ("abnormal_exit", "error_keyword")


@dataclass(frozen=True)
class Verdict:
    blamed: Finding
    also: list[Finding]
    collateral: list[Finding]


def _rank(reports: dict[str, dict[str, Any]], finding: Finding) -> dict[str, Any]:
    ranks = reports.get(finding.node or "", {}).get("ranks", [])
    return next((r for r in ranks if r.get("rank") == finding.rank), {})


def event_time(finding: Finding, reports: dict[str, dict[str, Any]]) -> float | None:
    """When the event behind a finding happened, on the executors' clocks (None: unknown)."""
    report = reports.get(finding.node or "", {})
    if finding.kind in RANK_FINDINGS:
        rank = _rank(reports, finding)
        if rank.get("exited_at") is not None:
            return float(rank["exited_at"])
        return float(report["time"]) if "time" in report else None
    if finding.kind == "heartbeat_lost":  # the node went silent after its last report
        return float(report["time"]) if "time" in report else None
    return None


def killed_by_signal(finding: Finding, reports: dict[str, dict[str, Any]]) -> bool:
    code = _rank(reports, finding).get("exitcode") if finding.kind == "abnormal_exit" else None
    return code is not None and code < 0 and -code != signal.SIGABRT


def attribute(faults: list[Finding], reports: dict[str, dict[str, Any]], waited_enough: bool) -> Verdict | None:
    """The verdict over this attempt's faults, or None while some node may still hold an earlier
    event (its newest report predates the earliest event seen) and `waited_enough` is false."""
    times = [event_time(f, reports) for f in faults]
    known = [t for t in times if t is not None]
    lost = {f.node for f in faults if f.kind == "heartbeat_lost"}
    if known and not waited_enough:
        earliest = min(known)
        if any(node not in lost and report.get("time", -math.inf) < earliest for node, report in reports.items()):
            return None
    order = sorted(
        range(len(faults)),
        key=lambda i: (math.inf if times[i] is None else times[i], not killed_by_signal(faults[i], reports), i),
    )
    blamed, blamed_time = faults[order[0]], times[order[0]]
    also, collateral = [], []
    for i in order[1:]:
        finding = faults[i]
        same_rank = finding.node == blamed.node and finding.rank == blamed.rank
        after = times[i] is None or blamed_time is None or times[i] >= blamed_time
        if finding.kind in RANK_FINDINGS and not same_rank and after and not killed_by_signal(finding, reports):
            collateral.append(finding)
        else:
            also.append(finding)
    return Verdict(blamed, also, collateral)
