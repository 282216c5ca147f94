"""The two recovery paths, as the driver runs them once a fault is blamed.

Fast path (`resilience.in_place`, when `decide.recovery_path` allows it): PAUSE -> the new
attempt. Every live active node gets `pause`: the failed ranks (or all ranks of a node that
leaves) are killed, the others drop their process groups and wait with their state in memory.
Then spares take the slots of leaving nodes (which run their self-check beside the new attempt
when the rule asks for one, and become spares again if they pass), and attempt k+1 starts with
`keep` naming the paused ranks: they rejoin under the new rendezvous, the replacements are
warm standbys, and every rank restores from peer memory (or storage).

Restart path (everything else, and the fast path's fallback): STOPPING (every rank killed) ->
CHECKING (when the self-check rule asks for one) -> every rank restarted at attempt k+1 from
the newest valid checkpoint, with spares in the slots of evicted nodes or dp shrunk.
Both record the path, its reason and each phase's time (`recovery.py`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from megascale.resilience.driver import evidence, selfcheck_plan
from megascale.resilience.driver.decide import (
    EVICTING_KINDS,
    IN_PLACE,
    RESTART,
    PathDecision,
    hang_culprits,
    recovery_path,
    selfcheck_decision,
)
from megascale.resilience.driver.placement import shrink_cost, slot_ranks, usable_nodes
from megascale.resilience.driver.rules import Finding
from megascale.resilience.driver.state import (
    ACTIVE,
    CHECKING,
    EVICTED,
    FAILED,
    RECOVERING,
    SPARE,
    STOPPING,
    SUSPECT,
    Node,
)
from megascale.resilience.selfcheck.verdict import judge

log = logging.getLogger("megascale.driver")
REPROBES = 3  # a stop that reached no node is sent again this often (each after stop_timeout_s)


class RecoveryPaths:
    """Mixed into the `Driver`: it owns the state, the outbox and the events these methods use."""

    def _begin_recovery(
        self, finding: Finding, now: float, others: list[Finding] = (), collateral: list[Finding] = ()
    ) -> None:
        record = {
            **finding.to_dict(),
            "attempt": self.state.attempt,
            "detected": now,
            "last_progress": self.hang.last_progress,
            "step": self.hang.last_step,
            "also": [f.to_dict() for f in others],
            "collateral": [f.to_dict() for f in collateral],
        }
        if finding.kind == "hang":
            record["culprits"] = hang_culprits(
                {n.node_id: self.reports.get(n.node_id, {}) for n in self.state.role(ACTIVE)}
            )
            run_dir, layout = self.state.run_dir, dict(self.state.layout)
            self._in_background(
                "hang",
                lambda: self.store.event(
                    "hang_analysis", {"detected": now, "analysis": evidence.hang_evidence(run_dir, layout)}
                ),
                limited=False,
            )
        if finding.node in self.state.nodes:
            self.state.nodes[finding.node].faults += 1
        if finding.kind == "manual_evict":
            self.manual_evictions.pop(finding.node, None)
        if finding.kind in EVICTING_KINDS:
            record["evict"] = True
        node = self.state.nodes.get(finding.node or "")
        check = selfcheck_decision(record, node.faults if node else 0, self.rcfg.max_node_faults)
        path = recovery_path(
            enabled=self.rcfg.in_place,
            fault=record,
            check=check,
            slots={n.node_id: n.slot for n in self.state.role(ACTIVE)},
            spares=[n.node_id for n in self.state.role(SPARE)],
            ranks_per_node=self.state.ranks_per_node,
            node_faults={n.node_id: n.faults for n in self.state.nodes.values()},
            max_node_faults=self.rcfg.max_node_faults,
            live={n.node_id for n in self._live_nodes(now)},
        )
        record.update(selfcheck=check.to_dict(), path=path.path, path_reason=path.reason, plan=path.to_dict())
        log.error("FAULT %s: %s -- stopping attempt %d", finding.kind, finding.detail, self.state.attempt)
        log.info("%s; recovery path: %s (%s)", check.describe(), path.path, path.reason)
        self.store.event("fault", record, now)
        self.current_fault, self.reprobes = record, 0
        if path.path == IN_PLACE:
            return self._pause(path, now)
        self.state.phase = STOPPING
        self._save()
        self._broadcast_phase_command("stop", self._live_nodes(now), now, self.rcfg.stop_timeout_s)

    def _live_nodes(self, now: float) -> list[Node]:
        return [
            n
            for n in self.state.nodes.values()
            if n.role != EVICTED and now - self.last_seen.get(n.node_id, 0) <= self.rcfg.heartbeat_timeout_s
        ]

    def _broadcast_phase_command(
        self, kind: str, nodes: list[Node], now: float, timeout_s: float, extra: dict[str, dict[str, Any]] | None = None
    ) -> None:
        self.waiting_for = {}
        for node in nodes:
            self.waiting_for[node.node_id] = self._send(node.node_id, kind, **(extra or {}).get(node.node_id, {}))
        self.phase_deadline = now + timeout_s

    def _send(self, node_id: str, kind: str, **fields: Any) -> str:
        command = {"id": f"{kind}-{uuid.uuid4().hex[:12]}", "kind": kind, **fields}
        self.outbox.setdefault(node_id, []).append(command)
        return command["id"]

    def _phase_done(self, now: float) -> bool:
        """Every command of the phase answered, or its deadline passed; a command that reached
        no node at all (every node silent) is not done: it waits for the deadline."""
        answered = bool(self.waiting_for) and all(c in self.results for c in self.waiting_for.values())
        return answered or now >= self.phase_deadline

    def _tick_stopping(self, now: float) -> None:
        if not self.waiting_for and now >= self.phase_deadline and self.reprobes < REPROBES:
            self.reprobes += 1  # after a driver restart, or a stop no node was there to get
            return self._broadcast_phase_command("stop", self._live_nodes(now), now, self.rcfg.stop_timeout_s)
        if not self._phase_done(now):
            return
        stopped = {n for n, c in self.waiting_for.items() if c in self.results}
        self.store.event("stopped", {"attempt": self.state.attempt, "nodes": sorted(stopped)}, now)
        check = (self.current_fault or {}).get("selfcheck") or {"run": True, "rule": "no record of the fault"}
        if not check["run"]:
            self._evict_failed({}, {n: {"ok": True} for n in stopped}, now)
            return self._restart(now, check)
        live = [n for n in self._live_nodes(now) if n.node_id in stopped]
        reached = {n.node_id for n in live}  # by id: `n in live` would compare every field, O(N) each
        # Lost active nodes are judged (no result) but not paired: a link test with a node that
        # cannot answer would only cost its neighbours a rendezvous timeout.
        active = self.state.role(ACTIVE)
        spares = [n for n in self.state.role(SPARE) if n.node_id in reached]
        ring = [n for n in active if n.node_id in reached] + spares
        plan = selfcheck_plan.build(ring, self.state.ranks_per_node, self.rcfg)
        self.check_ring = [n.node_id for n in active + spares]
        self.state.phase = CHECKING
        self._save()
        self._broadcast_phase_command(
            "selfcheck",
            live,
            now,
            self.rcfg.selfcheck_timeout_s,
            {n: {"plan": p, "timeout_s": self.rcfg.selfcheck_timeout_s} for n, p in plan.items()},
        )

    def _tick_checking(self, now: float) -> None:
        if not self._phase_done(now):
            return
        reports = {n: self.results.get(self.waiting_for.get(n, "")) for n in self.check_ring}
        verdict = judge(reports, self.rcfg.selfcheck_min_ratio)
        self.store.event("selfcheck", {"attempt": self.state.attempt, "verdict": verdict, "reports": reports}, now)
        self._evict_failed(verdict["failed"], reports, now)
        self._restart(now, (self.current_fault or {}).get("selfcheck"))

    def _evict_failed(self, failed: dict[str, str], answered: dict[str, Any], now: float) -> None:
        """Evict the nodes the self-check failed, lost nodes (no heartbeat, or no answer to the
        phase's command), the node of a manual eviction and nodes at `max_node_faults`. The state
        is not saved per eviction (O(nodes) each): the caller's `_restart` saves it once."""
        fault = self.current_fault or {}
        for node in list(self.state.nodes.values()):
            if node.role == EVICTED:
                continue
            why = failed.get(node.node_id)
            lost = now - self.last_seen.get(node.node_id, 0) > self.rcfg.heartbeat_timeout_s
            if lost or not answered.get(node.node_id):
                why = why or "lost: no heartbeat or no answer to the recovery's command"
            if fault.get("evict") and node.node_id == fault.get("node"):
                why = why or fault.get("detail")
            if node.faults >= self.rcfg.max_node_faults:
                why = why or f"{node.faults} faults blamed on it (resilience.max_node_faults)"
            if why:
                self._evict(node, why, save=False)  # saved once, by the restart that follows

    def _evict(self, node: Node, why: str, save: bool = True) -> None:
        log.error("evicting %s (%s): %s", node.node_id, node.address, why)
        shared = any(
            n.address == node.address and n.role != EVICTED and n is not node for n in self.state.nodes.values()
        )
        # a spare's address is only its claim (it never trained there): blocking it would let a
        # join-token holder block a real spare's address in advance by registering it and going silent
        claimed = node.role == SPARE
        node.role, node.slot = EVICTED, -1
        self.silence.forget(node.node_id)  # no longer watched: its silence is nobody's evidence
        if not shared and not claimed and node.address not in self.state.blocked:
            self.state.blocked.append(node.address)  # addresses shared (local mode) stay open
        self._send(node.node_id, "exit")
        self.store.event("evict", {"node": node.node_id, "address": node.address, "reason": why})
        if save:
            self._save()

    def _restart(self, now: float, check: dict[str, Any] | None = None, reason: str = "") -> None:
        """Restart every rank (the path that always works): attempt k+1 on the nodes left."""
        s = self.state
        if s.restarts >= s.restart_budget:
            return self._finish(FAILED, f"restart budget of {s.restart_budget} used up")
        reason = reason or (self.current_fault or {}).get("path_reason") or "every rank restarts"
        self.store.event("decide", {"attempt": s.attempt, "path": RESTART, "reason": reason, "selfcheck": check}, now)
        log.info("recovery path: %s (%s)", RESTART, reason)
        active = s.role(ACTIVE)
        spares = s.role(SPARE)
        while len(active) < s.nodes_wanted and spares:
            spare = spares.pop(0)
            spare.role = ACTIVE
            active.append(spare)
            self.store.event("replace", {"node": spare.node_id, "attempt": s.attempt + 1})
        count = usable_nodes(self.cfg, len(active), s.nodes_wanted, s.ranks_per_node)
        if count == 0:
            return self._finish(FAILED, f"no layout fits the {len(active)} node(s) left")
        for extra in active[count:]:
            extra.role, extra.slot = SPARE, -1
        for slot, node in enumerate(active[:count]):
            node.slot = slot
        if count < s.nodes_wanted:
            cost = shrink_cost(self.cfg, s.nodes_wanted, len(active), count, s.ranks_per_node)
            log.warning("%s", cost)
            self.store.event("shrink", {"attempt": s.attempt + 1, "nodes": count, "cost": cost}, now)
        s.restarts += 1
        s.attempt += 1
        self._start_attempt(now)

    # ------------------------------------------------------------------ the fast path
    def _pause(self, path: PathDecision, now: float) -> None:
        """Healthy ranks drop their process groups and wait; the replaced ones are killed."""
        self.state.phase = RECOVERING
        self._save()
        nodes = [n for n in self._live_nodes(now) if n.role == ACTIVE]
        kill = {
            n.node_id: [
                r
                for r in slot_ranks(n.slot, self.state.ranks_per_node)
                if n.node_id in path.leaving or r in path.replaced
            ]
            for n in nodes
        }
        self._broadcast_phase_command(
            "pause",
            nodes,
            now,
            self.rcfg.stop_timeout_s + 1,
            {
                n.node_id: {
                    "attempt": self.state.attempt,
                    "kill": kill[n.node_id],
                    "timeout_s": self.rcfg.stop_timeout_s,
                }
                for n in nodes
            },
        )

    def _tick_recovering(self, now: float) -> None:
        if not self._phase_done(now):
            return
        fault = self.current_fault or {}
        plan = fault["plan"]
        results = {n: self.results.get(c) for n, c in self.waiting_for.items()}
        silent = sorted(n for n, r in results.items() if not r and n not in plan["leaving"])
        if silent:  # a survivor's state is unknown: the path that always works
            fault["path_reason"] = f"{', '.join(silent)} did not answer the pause: every rank restarts"
            log.error("fast path abandoned: %s", fault["path_reason"])
            self.state.phase = STOPPING
            self._save()
            return self._broadcast_phase_command("stop", self._live_nodes(now), now, self.rcfg.stop_timeout_s)
        replaced = {int(rank): node for rank, node in plan["replaced"].items()}
        for node_id, result in results.items():  # ranks that died meanwhile are replaced where they were
            if node_id not in plan["leaving"]:
                for rank in result.get("dead") or []:
                    replaced.setdefault(rank, node_id)
        self.store.event(
            "stopped",
            {
                "attempt": self.state.attempt,
                "nodes": sorted(results),
                "paused": {n: r.get("paused") for n, r in results.items() if r},
            },
            now,
        )
        s = self.state
        if s.restarts >= s.restart_budget:
            return self._finish(FAILED, f"restart budget of {s.restart_budget} used up")
        for leaving, spare in zip(plan["leaving"], plan["spares_in"], strict=True):
            node, incoming = s.nodes[leaving], s.nodes[spare]
            incoming.role, incoming.slot = ACTIVE, node.slot
            self._leave(node, fault, now)
            self.store.event("replace", {"node": spare, "for": leaving, "attempt": s.attempt + 1})
        keep = {
            n.node_id: [r for r in slot_ranks(n.slot, s.ranks_per_node) if r not in replaced] for n in s.role(ACTIVE)
        }
        self.store.event(
            "decide",
            {
                "attempt": s.attempt,
                "path": IN_PLACE,
                "reason": fault["path_reason"],
                "selfcheck": fault["selfcheck"],
                "kept": keep,
                "replaced": {str(r): n for r, n in replaced.items()},
            },
            now,
        )
        log.info(
            "recovery path: %s; ranks %s replaced, %d kept",
            IN_PLACE,
            sorted(replaced),
            sum(len(k) for k in keep.values()),
        )
        s.restarts += 1
        s.attempt += 1
        self._start_attempt(now, keep)

    def _leave(self, node: Node, fault: dict[str, Any], now: float) -> None:
        """A node the fast path takes out: checked beside the new attempt when the rule asks for
        it and the node answers (passing makes it a spare), evicted otherwise."""
        lost = now - self.last_seen.get(node.node_id, 0) > self.rcfg.heartbeat_timeout_s
        if fault.get("evict") and node.node_id == fault.get("node"):
            return self._evict(node, fault.get("detail") or "evicted by an operator")
        if node.faults >= self.rcfg.max_node_faults:
            return self._evict(node, f"{node.faults} faults blamed on it (resilience.max_node_faults)")
        if lost or not fault["selfcheck"]["run"]:
            return self._evict(node, "lost: no heartbeat" if lost else fault["detail"])
        node.role, node.slot = SUSPECT, -1
        plan = selfcheck_plan.build([node], self.state.ranks_per_node, self.rcfg)[node.node_id]
        self.background_checks[node.node_id] = (
            self._send(node.node_id, "selfcheck", plan=plan, timeout_s=self.rcfg.selfcheck_timeout_s),
            now + self.rcfg.selfcheck_timeout_s + self.rcfg.heartbeat_timeout_s,
        )
        log.info("%s runs its self-check while the job goes on without it", node.node_id)

    def _judge_background_checks(self, now: float) -> None:
        for node_id, (command, deadline) in list(self.background_checks.items()):
            node = self.state.nodes[node_id]
            if command not in self.results and now < deadline and node.role == SUSPECT:
                continue
            del self.background_checks[node_id]
            if node.role != SUSPECT:
                continue
            verdict = judge({node_id: self.results.get(command)}, self.rcfg.selfcheck_min_ratio)
            self.store.event(
                "selfcheck",
                {
                    "attempt": self.state.attempt,
                    "verdict": verdict,
                    "reports": {node_id: self.results.get(command)},
                    "background": True,
                },
                now,
            )
            if node_id in verdict["failed"]:
                self._evict(node, verdict["failed"][node_id])
            else:
                node.role = SPARE
                log.info("%s passed its self-check: a spare again", node_id)
                self._save()
