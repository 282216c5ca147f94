"""What a recovery does once a fault is blamed: run the self-check or not, and which path to take.

Self-check only when the evidence points at the hardware or the network: a lost heartbeat or
traffic at zero (the node or its link), an error line naming the transport or the device
(NCCL/gloo transport errors, CUDA errors, ECC, illegal memory access), a hang in which no rank's
process is to blame, or repeated faults on one node (at least 2, and one short of
`max_node_faults`, which evicts). A Python exception or a killed process says nothing about the
machine: checking would only cost the job the self-check's time; a straggler is evicted on its
peers' evidence (`straggler_rule.py`), which a check would not change.

The fast path keeps the healthy ranks alive and replaces only the failed ones; it needs the
layout to stay the same (a host for every replaced rank: its own node, or a spare when the node
goes) and every surviving node to be reporting. Anything else falls back to restarting every
rank (as does a fast recovery the driver's own restart interrupted: `driver.py`).
Pure logic over the fault record and the nodes: no I/O, no clock.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

IN_PLACE, RESTART = "in_place", "restart"
NODE_KINDS = {
    "heartbeat_lost": "the node stopped sending heartbeats",
    "traffic_zero": "the node's network traffic stopped",
}
# error lines that name the transport or the device rather than the program
HARDWARE_PATTERN = re.compile(
    r"NCCL error|nccl(Internal|System|Remote)Error|CUDA error|uncorrectable ECC|illegal memory access"
    r"|Xid|NVLink|gloo/transport|Connection reset by peer|No route to host|Network is unreachable",
    re.IGNORECASE,
)
# faults whose node leaves and is evicted without a self-check (the evidence is already in)
EVICTING_KINDS = ("manual_evict", "straggler")
# process states (psutil) that blame a hang on the process itself, not the machine
PROCESS_STATES = ("stopped", "tracing-stop", "zombie", "dead")


@dataclass(frozen=True)
class CheckDecision:
    run: bool
    rule: str  # the rule that decided, in words
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.inputs.items())
        return f"self-check {'runs' if self.run else 'skipped'}: {self.rule} ({shown})"


def selfcheck_decision(fault: dict[str, Any], node_faults: int, max_node_faults: int) -> CheckDecision:
    """Whether the blamed fault (and the findings listed with it) warrant a self-check."""
    findings = [fault, *fault.get("also", [])]
    inputs = {
        "kind": fault.get("kind"),
        "node": fault.get("node"),
        "rank": fault.get("rank"),
        "node_faults": node_faults,
    }
    for finding in findings:
        if finding.get("kind") in NODE_KINDS:
            return CheckDecision(True, NODE_KINDS[finding["kind"]], {**inputs, "finding": finding["kind"]})
    for finding in findings:
        match = HARDWARE_PATTERN.search(finding.get("detail") or "")
        if finding.get("kind") == "error_keyword" and match:
            return CheckDecision(
                True, "an error line names the transport or the device", {**inputs, "matched": match.group(0)}
            )
    if fault.get("kind") == "hang":
        culprits = fault.get("culprits", [])
        if culprits:
            return CheckDecision(
                False,
                "a hang whose rank's process is stopped or gone: the process, not the machine",
                {**inputs, "culprits": culprits},
            )
        return CheckDecision(True, "a hang with no process to blame may be the network", inputs)
    if fault.get("kind") == "straggler":
        return CheckDecision(False, "a straggler is replaced on its peers' evidence: nothing to find out", inputs)
    if node_faults >= max(2, max_node_faults - 1):  # the next fault would evict it anyway
        return CheckDecision(True, "repeated faults on one node", {**inputs, "limit": max_node_faults})
    if fault.get("kind") == "manual_evict":
        return CheckDecision(False, "an operator evicts the node: nothing to find out", inputs)
    return CheckDecision(False, "a process fault (exit, signal or exception) is no hardware symptom", inputs)


def hang_culprits(reports: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks whose process cannot be taking part in a collective: stopped, a zombie, gone."""
    return [
        {"node": node, "rank": r["rank"], "state": r.get("state")}
        for node, report in sorted(reports.items())
        for r in report.get("ranks", [])
        if r.get("state") in PROCESS_STATES
    ]


@dataclass(frozen=True)
class PathDecision:
    path: str  # IN_PLACE or RESTART
    reason: str
    replaced: dict[int, str] = field(default_factory=dict)  # rank -> node that starts it afresh
    leaving: list[str] = field(default_factory=list)  # nodes whose ranks all go (to check or evict)
    spares_in: list[str] = field(default_factory=list)  # spares that take a leaving node's slot

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "replaced": {str(k): v for k, v in self.replaced.items()}}


def recovery_path(
    *,
    enabled: bool,
    fault: dict[str, Any],
    check: CheckDecision,
    slots: dict[str, int],
    spares: list[str],
    ranks_per_node: int,
    node_faults: dict[str, int],
    max_node_faults: int,
    live: set[str],
) -> PathDecision:
    """The path for a blamed fault. `slots`: active node -> slot; `live`: nodes heard from lately.

    Ranks replaced: the blamed rank (and any rank listed as also failed) on its own node; every
    rank of a node that leaves (lost, evicted, or to be checked while a spare takes its place)."""
    if not enabled:
        return PathDecision(RESTART, "resilience.in_place is off")
    findings = [fault, *fault.get("also", [])]
    failed_nodes = {f["node"] for f in [*findings, *fault.get("culprits", [])] if f.get("node") in slots}
    if not failed_nodes:
        return PathDecision(RESTART, f"no node is blamed for the {fault.get('kind')} (no rank to replace)")
    leaving = sorted(
        n
        for n in failed_nodes
        if n not in live
        or (check.run and n == fault.get("node"))
        or fault.get("kind") in EVICTING_KINDS
        or node_faults.get(n, 0) >= max_node_faults
        or fault.get("kind") in NODE_KINDS
    )
    survivors = [n for n in slots if n not in leaving]
    if not survivors:
        return PathDecision(RESTART, "no node survives the fault")
    if any(n not in live for n in survivors):
        return PathDecision(RESTART, f"nodes {sorted(n for n in survivors if n not in live)} are not reporting")
    usable = [s for s in spares if s in live]
    if len(usable) < len(leaving):
        return PathDecision(
            RESTART, f"{len(leaving)} node(s) leave and {len(usable)} spare(s) can take over: the layout would change"
        )
    replaced: dict[int, str] = {}
    spares_in = usable[: len(leaving)]
    for node, spare in zip(leaving, spares_in, strict=True):
        for rank in range(slots[node] * ranks_per_node, (slots[node] + 1) * ranks_per_node):
            replaced[rank] = spare
    for f in findings:
        if f.get("node") in survivors and f.get("rank") is not None:
            replaced[int(f["rank"])] = f["node"]
    for culprit in fault.get("culprits", []):
        if culprit["node"] in survivors:
            replaced[int(culprit["rank"])] = culprit["node"]
    if not replaced:
        return PathDecision(RESTART, f"the {fault.get('kind')} names no rank to replace")
    return PathDecision(IN_PLACE, "healthy ranks stay; failed ones are replaced", replaced, leaving, spares_in)
