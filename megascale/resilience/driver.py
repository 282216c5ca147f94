"""The driver: one per job. Keeps the job's state, watches heartbeats, recovers from faults.

Control loop (a tick every 0.25 s): STARTING waits for the nodes to register, then sends each
active node a `start` for attempt k (ranks, world, rendezvous address chosen per attempt).
RUNNING evaluates the detection rules on the latest heartbeats. A fault starts one of the two
recovery paths (`paths.py`): the fast one (RECOVERING: healthy ranks paused, failed ones
replaced, state from peer memory) or the restart (STOPPING, CHECKING when the self-check rule
asks for it, every rank restarted from the newest valid checkpoint), then RUNNING at attempt
k+1. The state is written to SQLite on each change, so a restarted driver resumes where its
predecessor stopped (a fast recovery it interrupted is redone as a restart); executors simply
keep sending heartbeats until one answers.
Handlers get bodies the API's schemas (`protocol.py`) accepted; ranks get their config as one
TOML text per attempt (their executor writes it to a 0600 file), with no secret in it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from megascale.config.fields import ConfigError
from megascale.config.handoff import attempt_config
from megascale.config.schema import JobConfig
from megascale.plan.env import format_applied, launch_env
from megascale.resilience import evidence
from megascale.resilience.attribution import Verdict, attribute
from megascale.resilience.ettr import job_summary
from megascale.resilience.identity import admission
from megascale.resilience.paths import RecoveryPaths
from megascale.resilience.placement import PlacementError, layout_for, rendezvous_port, slot_ranks
from megascale.resilience.progress import ProgressCheck
from megascale.resilience.protocol import log_safe
from megascale.resilience.recovery import recovery_phases, start_marks
from megascale.resilience.rules import (
    Finding,
    TrafficRule,
    abnormal_exits,
    error_lines,
    hang_rule,
    interface_bytes,
    missing_heartbeats,
    slow_rule,
)
from megascale.resilience.state import (
    ACTIVE,
    CANCELLED,
    CHECKING,
    COMPLETE,
    EVICTED,
    FAILED,
    FINISHED,
    RECOVERING,
    RUNNING,
    SPARE,
    STARTING,
    STOPPING,
    SUSPECT,
    JobState,
    JobStore,
    Node,
)

log = logging.getLogger("megascale.driver")
TICK_S = 0.25


class Driver(RecoveryPaths):
    def __init__(self, cfg: JobConfig, state: JobState, store: JobStore) -> None:
        self.cfg, self.rcfg, self.state, self.store = cfg, cfg.resilience, state, store
        self.lock = threading.RLock()
        self.reports: dict[str, dict[str, Any]] = {}
        self.last_seen: dict[str, float] = {}
        self.outbox: dict[str, list[dict[str, Any]]] = {}
        self.results: dict[str, dict[str, Any]] = {}  # command id -> executor's result
        self.errors: list[Finding] = []
        self.alerts: list[dict[str, Any]] = []
        self.hang = hang_rule(self.rcfg, cfg.train.steps)
        self.slow = slow_rule(self.rcfg)
        self.progress = ProgressCheck(cfg.train.steps, self.rcfg.max_step_rate)
        self.traffic: dict[str, TrafficRule] = {}
        self.phase_deadline = 0.0
        self.waiting_for: dict[str, str] = {}  # node -> command id the phase waits on
        self.manual_evictions: dict[str, str] = {}
        self.current_fault: dict[str, Any] | None = None
        self.check_ring: list[str] = []
        self.evidence_threads: list[threading.Thread] = []
        self.resumed_pending: dict[str, Any] | None = None
        self.plan_env = launch_env(state.run_dir, cfg.diagnostics.flight_recorder)
        self.held_faults: list[Finding] = []  # faults awaiting every node's evidence (attribution)
        self.held_since = 0.0
        self.tick_failure, self.tick_failure_logged = "", 0.0
        self.background_checks: dict[str, tuple[str, float]] = {}  # suspect node -> (command, deadline)
        now = time.time()
        for node in state.nodes.values():
            if node.role != EVICTED:
                self.last_seen[node.node_id] = now  # a restarted driver gives everyone a grace
        if state.phase in (STOPPING, CHECKING, RECOVERING):  # redo the interrupted recovery from the start
            self.current_fault = (store.events("fault") or [None])[-1]
            if state.phase == RECOVERING and self.current_fault is not None:
                self.current_fault["path_reason"] = ("the driver restarted during the fast recovery: the paused "
                                                     "ranks' state is unknown, every rank restarts")
                log.warning("%s", self.current_fault["path_reason"])
            state.phase, self.phase_deadline = STOPPING, now
        for node in state.role(SUSPECT):  # its self-check's result went with the old driver
            self._evict(node, "its self-check was interrupted by a driver restart")
        self.hang.reset(now)

    # ------------------------------------------------------------------ API handlers
    def on_register(self, body: dict[str, Any], proven: bool = False) -> tuple[int, dict[str, Any]]:
        """`proven`: the caller holds this node's own credential (`identity.py`), not the join token."""
        node_id, address = body["node_id"], body["address"]
        with self.lock:
            known = self.state.nodes.get(node_id)
            if (known and known.role == EVICTED) or address in self.state.blocked:
                return 403, {"error": f"node {node_id} ({address}) is evicted from this job"}
            refusal = admission(self.state, node_id, address, proven, self.rcfg.spare_pool)
            if refusal is not None:
                return refusal
            if known is None:
                known = Node(node_id, address, body["host"], registered=time.time())
                self.state.nodes[node_id] = known
                if self.state.phase == STARTING and len(self.state.role(ACTIVE)) < self.state.nodes_wanted:
                    known.role, known.slot = ACTIVE, len(self.state.role(ACTIVE))
            known.address, known.host, known.pid = address, body["host"], body["pid"]
            self.last_seen[node_id] = time.time()
            self._save()
            self.store.event("register", {"node": node_id, "address": address, "role": known.role})
            log.info("node %s registered from %s as %s", node_id, address, known.role)
            return 200, {"role": known.role, "keywords": self.rcfg.error_keywords,
                         "heartbeat_s": self.rcfg.heartbeat_s, "standby": self._standby_for(known)}

    def on_heartbeat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        node_id = body["node_id"]
        with self.lock:
            node = self.state.nodes.get(node_id)
            if node is None:
                return 404, {"error": f"unknown node {node_id}: register first"}
            if node.role == EVICTED:
                return 403, {"error": f"node {node_id} is evicted"}
            now = time.time()
            implausible = self.progress.refuse(node, body, self.state, now)
            if implausible is not None:
                return 422, {"error": f"implausible progress from {node_id}: {implausible}"}
            self.last_seen[node_id] = now
            self.reports[node_id] = body
            sent = {c["id"] for c in self.outbox.get(node_id, [])}
            for command_id, result in body["done"].items():
                if command_id in sent:  # not a result for a command another node (or nobody) got
                    self.results[command_id] = result
            self.outbox[node_id] = [c for c in self.outbox.get(node_id, []) if c["id"] not in self.results]
            if self.state.phase == RUNNING and body.get("attempt") == self.state.attempt:
                self.errors += error_lines(node_id, body.get("errors", []), self.rcfg.error_keywords)
                if node.role == ACTIVE:
                    self._observe_progress(node_id, body, now)
            commands = self.outbox[node_id]
            # `exit` is never acknowledged (the executor is gone): delivered once is enough
            self.outbox[node_id] = [c for c in commands if c["kind"] != "exit"]
            return 200, {"commands": commands, "ack": list(body.get("done", {})), "standby": self._standby_for(node),
                         "heartbeat_s": self._heartbeat_for()}

    def _standby_for(self, node: Node) -> int:
        """Warm rank processes a node keeps: an active node one per rank before the first start
        (the first ranks are standbys too), `resilience.standby` after; a spare one per rank once
        the job trains (before, their imports would only slow the job's start)."""
        if node.role == ACTIVE:
            return self.state.ranks_per_node if self.state.phase == STARTING else self.rcfg.standby
        started = self.state.attempt > 0 or self.hang.last_step > 0
        return self.state.ranks_per_node if node.role == SPARE and started else 0

    def _heartbeat_for(self) -> float:
        """While a recovery runs (until the new attempt's first step), executors beat 5x faster:
        each command and result of the recovery waits for a heartbeat."""
        recovering = self.state.phase in (RECOVERING, STOPPING, CHECKING) or self.resumed_pending is not None
        return self.rcfg.heartbeat_s / 5 if recovering else self.rcfg.heartbeat_s

    def on_status(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            s = self.state
            now = time.time()
            events = self.store.events()
            return 200, {
                "job_id": s.job_id, "phase": s.phase, "attempt": s.attempt, "restarts": s.restarts,
                "restart_budget": s.restart_budget, "layout": s.layout, "reason": s.reason,
                "nodes": {n.node_id: {"role": n.role, "slot": n.slot, "address": n.address,
                                      "host": n.host, "faults": n.faults, "pid": n.pid,
                                      "last_seen_s": round(now - self.last_seen.get(n.node_id, 0), 1),
                                      "attempt": self.reports.get(n.node_id, {}).get("attempt"),
                                      "ranks": self.reports.get(n.node_id, {}).get("ranks", [])}
                          for n in s.nodes.values()},
                "evicted": s.evicted, "blocked": s.blocked, "step": self.hang.last_step,
                "faults": [{**f, **recovery_phases(f, events)} for f in events if f["event"] == "fault"],
                "alerts": [e for e in events if e["event"] == "alert"],
                "master": s.master,
            }

    def on_evict(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        node_id = body["node_id"]
        with self.lock:
            if node_id not in self.state.nodes:
                return 404, {"error": f"unknown node {node_id}"}
            self.manual_evictions[node_id] = log_safe(body.get("reason") or "evicted by an operator")
        return 200, {"ok": True}

    def on_stop(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self._finish(CANCELLED, log_safe(body.get("reason") or "stopped by an operator"))
        return 200, {"ok": True}

    # ------------------------------------------------------------------ observations
    def _observe_progress(self, node_id: str, body: dict[str, Any], now: float) -> None:
        ranks = body.get("ranks", [])
        steps = [r["step"] for r in ranks if r.get("step") is not None]
        recent = [(int(s), float(t)) for r in ranks for s, t in r.get("recent", [])]
        if steps:
            before = self.hang.last_step
            self.hang.observe(max(steps), recent, now)
            if self.resumed_pending is not None and self.hang.last_step > before:
                ranks = [r for n in self.state.role(ACTIVE) for r in self.reports.get(n.node_id, {}).get("ranks", [])]
                self.store.event("resumed", {**self.resumed_pending, "step": self.hang.last_step,
                                             "resumed": now, **start_marks(ranks)})
                self.resumed_pending = None
        for step, seconds in recent:
            self.slow.observe(step, seconds)
        rule = self.traffic.setdefault(node_id, TrafficRule(node_id, self.rcfg.traffic_window_s,
                                                            self.rcfg.traffic_fall_ratio))
        total = interface_bytes(body.get("net", {}), self.rcfg.traffic_interfaces)
        running = bool(ranks) and all(r.get("alive") for r in ranks)
        if total is not None and not body.get("net_shared"):
            finding = rule.observe(total, now, running)
            if finding is not None:
                self.errors.append(finding)

    # ------------------------------------------------------------------ control loop
    def run(self, stop: threading.Event | None = None) -> int:
        stop = stop or threading.Event()
        while not stop.is_set():
            with self.lock:
                self._guarded_tick(time.time())
                if self.state.phase in FINISHED and not any(self.outbox.values()):
                    break
            stop.wait(TICK_S)
        return 0 if self.state.phase == COMPLETE else 1

    def _guarded_tick(self, now: float) -> None:
        try:  # a defect no schema caught costs a tick and a logged traceback, never the job
            self.tick(now)
        except Exception as exc:
            if repr(exc) != self.tick_failure or now - self.tick_failure_logged > 60:
                log.exception("control loop tick failed; carrying on")
                self.tick_failure, self.tick_failure_logged = repr(exc), now

    def tick(self, now: float) -> None:
        phase = self.state.phase
        if phase == STARTING:
            self._tick_starting(now)
        elif phase == RUNNING:
            self._tick_running(now)
        elif phase == STOPPING:
            self._tick_stopping(now)
        elif phase == CHECKING:
            self._tick_checking(now)
        elif phase == RECOVERING:
            self._tick_recovering(now)
        elif phase in FINISHED:
            self._drain_exits(now)

    def _tick_starting(self, now: float) -> None:
        active = self.state.role(ACTIVE)
        if len(active) >= self.state.nodes_wanted:
            self._start_attempt(now)
        elif now - self.state.created > self.rcfg.startup_timeout_s:
            self._finish(FAILED, f"only {len(active)} of {self.state.nodes_wanted} nodes registered "
                                 f"within {self.rcfg.startup_timeout_s:.0f} s")

    def _tick_running(self, now: float) -> None:
        for node_id, reason in list(self.manual_evictions.items()):
            node = self.state.nodes[node_id]
            if node.role == SPARE:
                self._evict(node, reason)
                del self.manual_evictions[node_id]
            else:
                return self._begin_recovery(Finding("manual_evict", "fault", reason, node_id), now)
        self._judge_background_checks(now)
        findings = self._findings(now)
        for f in findings:
            if f.severity == "alert":
                self._alert(f, now)
        faults = [f for f in findings if f.severity == "fault"]
        lost_spares = [f for f in faults if f.node and self.state.nodes[f.node].role in (SPARE, SUSPECT)]
        for f in lost_spares:
            self._evict(self.state.nodes[f.node], f.detail)
        faults = [f for f in faults if f not in lost_spares]
        if faults:
            verdict = self._attribute(faults, now)
            if verdict is not None:
                return self._begin_recovery(verdict.blamed, now, others=verdict.also,
                                            collateral=verdict.collateral)
            return None
        if self._complete():
            self._finish(COMPLETE, "training complete")

    def _findings(self, now: float) -> list[Finding]:
        out: list[Finding] = []
        watched = {n.node_id: t for n_id, t in self.last_seen.items()
                   if (n := self.state.nodes[n_id]).role != EVICTED}
        out += missing_heartbeats(watched, now, self.rcfg.heartbeat_timeout_s)
        all_alive = True
        for node in self.state.role(ACTIVE):
            report = self.reports.get(node.node_id, {})
            if report.get("attempt") != self.state.attempt:
                all_alive = False
                continue
            done = self.cfg.train.steps  # a crash in teardown after the last step loses nothing
            out += abnormal_exits(node.node_id, [r for r in report.get("ranks", []) if (r.get("step") or 0) < done])
            all_alive &= all(r.get("alive") for r in report.get("ranks", []))
        out += self.errors
        self.errors = []
        hang = self.hang.check(now, all_alive)
        if hang is not None:
            out.append(hang)
        slow = self.slow.check()
        if slow is not None:
            out.append(slow)
        return out

    def _complete(self) -> bool:
        ranks = [r for n in self.state.role(ACTIVE)
                 for r in self.reports.get(n.node_id, {}).get("ranks", [])
                 if self.reports[n.node_id].get("attempt") == self.state.attempt]
        world = self.state.ranks_per_node * len(self.state.role(ACTIVE))
        if len(ranks) < world or any(r.get("alive") or (r.get("step") or 0) < self.cfg.train.steps
                                     for r in ranks):
            return False
        for r in ranks:
            if r.get("exitcode") != 0:
                self.store.event("alert", {"kind": "exit_after_last_step", "severity": "alert",
                                           "detail": f"rank {r['rank']} exited with {r['exitcode']} "
                                                     "after the last step (teardown)", "rank": r["rank"]})
        return True

    def _alert(self, finding: Finding, now: float) -> None:
        log.warning("ALERT %s: %s", finding.kind, finding.detail)
        if finding.kind != "slow":
            return self.store.event("alert", finding.to_dict(), now)
        self._in_background(lambda: self.store.event("alert", {
            **finding.to_dict(), "stragglers": evidence.straggler_evidence(
                self.state.run_dir, Path(self.state.run_dir) / "config.toml")}, now))

    def _in_background(self, work) -> None:
        """Evidence reads files and imports the diagnostics (and torch): seconds that must not
        be spent holding the lock every heartbeat needs."""
        thread = threading.Thread(target=work, name="evidence", daemon=True)
        thread.start()
        self.evidence_threads.append(thread)

    def _attribute(self, faults: list[Finding], now: float) -> Verdict | None:
        """Hold this attempt's faults until every node's evidence is in (error lines are handed
        over once, so they are kept here); see `attribution`."""
        if not self.held_faults:
            self.held_since = now
        self.held_faults = list(dict.fromkeys(self.held_faults + faults))
        reports = {n.node_id: self.reports.get(n.node_id, {}) for n in self.state.role(ACTIVE)}
        verdict = attribute(self.held_faults, reports, now - self.held_since >= self.rcfg.heartbeat_timeout_s)
        if verdict is not None:
            self.held_faults = []
        return verdict

    def _start_attempt(self, now: float, keep: dict[str, list[int]] | None = None) -> None:
        """Attempt k's `start` to every active node; `keep`: per node, the paused ranks that rejoin."""
        s = self.state
        active = s.role(ACTIVE)
        try:
            s.layout = layout_for(self.cfg, len(active), s.ranks_per_node)
            # ranks of a failed attempt must die on SIGTERM, not wait for peers to agree on a save:
            # the driver stops them itself and restarts from the last committed checkpoint
            password = self.cfg.parallel.redis_password() if self.cfg.parallel.store == "redis" else None
            config = attempt_config(s.train_config, dp=s.layout["dp"], run_dir=s.run_dir, redis_password=password)
        except (PlacementError, ConfigError) as exc:
            return self._finish(FAILED, str(exc))
        active = self._in_planned_order(active)
        s.master = {"addr": active[0].address, "port": rendezvous_port(self.rcfg.rendezvous_port, s.attempt)}
        env = {"WORLD_SIZE": str(len(active) * s.ranks_per_node), "MASTER_ADDR": s.master["addr"],
               "MASTER_PORT": str(s.master["port"]), "MEGASCALE_JOB_ID": s.job_id,
               "MEGASCALE_RESTART_ATTEMPT": str(s.attempt)}
        for node in active:
            self._send(node.node_id, "start", attempt=s.attempt, ranks=slot_ranks(node.slot, s.ranks_per_node),
                       env=env, plan_env=self.plan_env, config=config, redis_password=password,
                       keep=(keep or {}).get(node.node_id, []))
        s.phase, s.attempt_started = RUNNING, now
        self.hang.reset(now)
        self.slow.reset()
        self.traffic.clear()
        self.waiting_for = {}
        if self.current_fault is not None:
            self.resumed_pending = {"attempt": s.attempt, "fault_detected": self.current_fault["detected"]}
            self.current_fault = None
        if self.cfg.parallel.store == "redis" and s.attempt > 0:
            previous = s.attempt - 1  # bound now: the thread may run after a further restart
            self._in_background(lambda: self._clear_rendezvous(previous))
        self.store.event("attempt", {"attempt": s.attempt, "layout": s.layout, "master": s.master,
                                     "nodes": [n.node_id for n in active]}, now)
        log.info("attempt %d: %s on %s (rendezvous %s:%d); %s", s.attempt, s.layout,
                 ", ".join(n.node_id for n in active), s.master["addr"], s.master["port"],
                 format_applied(self.plan_env))
        self._save()

    def _in_planned_order(self, active: list[Node]) -> list[Node]:
        """The active nodes in the planner's placement order (slot k runs ranks k*R...) when
        the job was given a topology; the order it has otherwise."""
        source = self.state.api.get("topology")
        if source:
            from megascale.plan.apply import order_nodes  # brings in torch: only when asked for

            active, line = order_nodes(source, active, self.state.layout, self.state.ranks_per_node)
            log.info(line)
        for slot, node in enumerate(active):
            node.slot = slot
        return active

    def _clear_rendezvous(self, attempt: int) -> None:
        """Delete a dead attempt's keys from the shared Redis store (its ranks are all stopped;
        the prefixes keep the next attempt safe either way, this only stops keys piling up).
        Runs in the background: the imports bring in torch."""
        import redis

        from megascale.parallel.redis_store import delete_prefix
        from megascale.parallel.store import attempt_prefix

        prefix = attempt_prefix(self.state.job_id, attempt)
        try:
            n = delete_prefix(self.cfg.parallel.redis_url, prefix, self.cfg.parallel.redis_password())
        except redis.RedisError as exc:
            log.warning("could not clear attempt %d's rendezvous keys from Redis: %s", attempt, exc)
            return
        log.info("cleared %d rendezvous keys of attempt %d", n, attempt)

    # ------------------------------------------------------------------ the end
    def _finish(self, phase: str, reason: str) -> None:
        s = self.state
        if s.phase in FINISHED:
            return
        s.phase, s.reason, s.finished = phase, reason, time.time()
        for node in s.nodes.values():
            if node.role != EVICTED:
                self._send(node.node_id, "exit")
        self.phase_deadline = s.finished + self.rcfg.stop_timeout_s
        for thread in self.evidence_threads:  # their alerts belong in the summary
            thread.join(30)
        summary = self.summary()
        self.store.event("finish", summary)
        (Path(s.run_dir) / "resilience").mkdir(parents=True, exist_ok=True)
        (Path(s.run_dir) / "resilience" / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        log.log(logging.INFO if phase == COMPLETE else logging.ERROR, "job %s: %s (ETTR %.3f)",
                phase, reason, summary["ettr"]["ettr"])
        self._save()

    def _drain_exits(self, now: float) -> None:
        if now >= self.phase_deadline:
            self.outbox.clear()  # executors that never came back for their exit are gone anyway

    def summary(self) -> dict[str, Any]:
        return job_summary(self.state, self.store, self.cfg.train.steps)

    def _save(self) -> None:
        self.store.save(self.state)

