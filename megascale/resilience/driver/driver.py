"""The driver: one per job. Keeps the job's state, watches heartbeats, recovers from faults.

Control loop (a tick every 0.25 s): STARTING waits for the nodes to register, then sends each
active node a `start` for attempt k (ranks, world, rendezvous address chosen per attempt).
RUNNING evaluates the detection rules on the latest heartbeats. A fault starts one of the two
recovery paths (`recovery_paths.py`): the fast one (RECOVERING: healthy ranks paused, failed ones
replaced, state from peer memory) or the restart (STOPPING, CHECKING when the self-check rule
asks for it, every rank restarted from the newest valid checkpoint), then RUNNING at attempt
k+1. The state is written to SQLite on each change, so a restarted driver resumes where its
predecessor stopped (a fast recovery it interrupted is redone as a restart); executors simply
keep sending heartbeats until one answers.
Bounded under load and over time: the lock guards memory only (a registration's row is written
after it, before the reply; status is built from a snapshot after it; evidence and Rendezvous
clean-up go to one bounded background queue); per heartbeat the work is O(the node's report),
per tick O(what changed), and every rule keeps windows, not histories. Most nodes silent at once
is taken for the driver's or the network's stall, never for their fault (`silence.py`).
Handlers get bodies the API's schemas (`protocol.py`) accepted; ranks get their config as one
TOML text per attempt (their executor writes it to a 0600 file), with no secret in it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megascale.config.fields import ConfigError
from megascale.config.handoff import attempt_config
from megascale.config.schema import JobConfig
from megascale.plan.env import format_applied, launch_env
from megascale.resilience.common.protocol import log_safe
from megascale.resilience.driver import evidence
from megascale.resilience.driver.attempt import AttemptWatch
from megascale.resilience.driver.attribution import Verdict, attribute
from megascale.resilience.driver.ettr import job_summary
from megascale.resilience.driver.identity import admission
from megascale.resilience.driver.placement import PlacementError, compute_scale, layout_for, rendezvous_port, slot_ranks
from megascale.resilience.driver.progress import ProgressCheck
from megascale.resilience.driver.recovery import recovery_phases, start_marks
from megascale.resilience.driver.recovery_paths import RecoveryPaths
from megascale.resilience.driver.roster import Roster
from megascale.resilience.driver.rules import (
    Finding,
    TrafficRule,
    error_lines,
    hang_rule,
    interface_bytes,
    slow_rule,
)
from megascale.resilience.driver.silence import SilenceWatch
from megascale.resilience.driver.state import (
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
from megascale.resilience.driver.straggler_rule import straggler_findings, straggler_rule

log = logging.getLogger("megascale.driver")
TICK_S = 0.25
STATUS_EVENTS = ("fault", "stopped", "decide", "selfcheck", "resumed", "alert")  # what `recovery_phases` reads
EVIDENCE_WAIT_S = 30.0  # at the end, for queued evidence whose alerts belong in the summary


# a rank report's per-step series, for the rules: not in the status (16 pairs a rank twice over
# made 5.8 MB and 5.5 s for one status at 1,536 nodes of 8 ranks)
RULES_ONLY = ("recent", "compute")


class Driver(RecoveryPaths):
    def __init__(self, cfg: JobConfig, state: JobState, store: JobStore, roster: Roster | None = None) -> None:
        self.cfg, self.rcfg, self.state, self.store = cfg, cfg.resilience, state, store
        self.roster = roster  # the node ids the job expects (roster.py); None: any within the pool
        self.lock = threading.RLock()
        self.reports: dict[str, dict[str, Any]] = {}
        self.silence = SilenceWatch(self.rcfg.heartbeat_timeout_s, self.rcfg.silence_fraction)
        self.last_seen = self.silence.last_seen  # node -> when last heard from, oldest first
        self.outbox: dict[str, list[dict[str, Any]]] = {}
        self.results: dict[str, dict[str, Any]] = {}  # command id -> executor's result
        self.errors: list[Finding] = []
        self.alerts: list[dict[str, Any]] = []
        self.hang = hang_rule(self.rcfg, cfg.train.steps)
        self.slow = slow_rule(self.rcfg)
        self.straggler = straggler_rule(self.rcfg)
        self.steps_seen: dict[int, int] = {}  # rank -> newest step whose time the rules have had
        self.progress = ProgressCheck(cfg.train.steps, self.rcfg.max_step_rate)
        self.traffic: dict[str, TrafficRule] = {}
        self.phase_deadline = 0.0
        self.waiting_for: dict[str, str] = {}  # node -> command id the phase waits on
        self.manual_evictions: dict[str, str] = {}
        self.current_fault: dict[str, Any] | None = None
        self.check_ring: list[str] = []
        self.background = evidence.BackgroundQueue()
        self.resumed_pending: dict[str, Any] | None = None
        self.resumed_seen: dict[str, Any] | None = None  # the "resumed" event, for the next tick to write
        self.plan_env = launch_env(state.run_dir, cfg.diagnostics.flight_recorder)
        self.held_faults: list[Finding] = []  # faults awaiting every node's evidence (attribution)
        self.held_since = 0.0
        self.tick_failure, self.tick_failure_logged = "", 0.0
        self.background_checks: dict[str, tuple[str, float]] = {}  # suspect node -> (command, deadline)
        self.reprobes = 0  # stops sent again because no node got the first (recovery_paths.py)
        self.attempt_watch = AttemptWatch(state.ranks_per_node, cfg.train.steps)
        self.attempt_watch.watch([n.node_id for n in state.role(ACTIVE)] if state.phase == RUNNING else [])
        now = time.time()
        self.registering_since = now  # the start-up timeout counts from here, and from each registration
        self.active_count = sum(1 for n in state.nodes.values() if n.role == ACTIVE)  # kept while STARTING
        for node in state.nodes.values():
            if node.role != EVICTED:
                self.last_seen[node.node_id] = now  # a restarted driver gives everyone a grace
        if state.phase in (STOPPING, CHECKING, RECOVERING):  # redo the interrupted recovery from the start
            self.current_fault = (store.events("fault") or [None])[-1]
            if state.phase == RECOVERING and self.current_fault is not None:
                self.current_fault["path_reason"] = (
                    "the driver restarted during the fast recovery: the paused "
                    "ranks' state is unknown, every rank restarts"
                )
                log.warning("%s", self.current_fault["path_reason"])
            state.phase, self.phase_deadline = STOPPING, now
        for node in state.role(SUSPECT):  # its self-check's result went with the old driver
            self._evict(node, "its self-check was interrupted by a driver restart")
        self.hang.reset(now)

    # ------------------------------------------------------------------ API handlers
    def on_register(self, body: dict[str, Any], proven: bool = False) -> tuple[int, dict[str, Any]]:
        """`proven`: the caller holds this node's own credential (`identity.py`), not the join token.
        O(1) under the lock; the node's row is committed after it and before the reply, so a
        node told its role is a node a restarted driver knows."""
        node_id, address = body["node_id"], body["address"]
        now = time.time()
        with self.lock:
            known = self.state.nodes.get(node_id)
            if (known and known.role == EVICTED) or address in self.state.blocked:
                return 403, {"error": f"node {node_id} ({address}) is evicted from this job"}
            refusal = admission(self.state, self.roster, node_id, address, proven, self.rcfg.spare_pool)
            if refusal is not None:
                return refusal
            if known is None:
                known = Node(node_id, address, body["host"], registered=now)
                self.state.nodes[node_id] = known
                if self.state.phase == STARTING and self.active_count < self.state.nodes_wanted:
                    known.role, known.slot = ACTIVE, self.active_count
                    self.active_count += 1
                    self.registering_since = now
            known.address, known.host, known.pid = address, body["host"], body["pid"]
            self.last_seen[node_id] = now
            row, seq = json.dumps(asdict(known)), self.store.sequence()
            reply = {
                "role": known.role,
                "keywords": self.rcfg.error_keywords,
                "heartbeat_s": self.rcfg.heartbeat_s,
                "standby": self._standby_for(known),
            }
        self.store.save_node(row, node_id, seq)
        self.store.event("register", {"node": node_id, "address": address, "role": reply["role"]}, now)
        log.info("node %s registered from %s as %s", node_id, address, reply["role"])
        return 200, reply

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
            self.attempt_watch.fresh.add(node_id)
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
            return 200, {
                "commands": commands,
                "ack": list(body.get("done", {})),
                "standby": self._standby_for(node),
                "heartbeat_s": self._heartbeat_for(),
            }

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
        """The lock is held for a shallow copy (references to nodes and reports, which are
        replaced, never changed in place, by heartbeats); the reply is built after it."""
        with self.lock:
            s = self.state
            now = time.time()
            head = {
                "job_id": s.job_id,
                "phase": s.phase,
                "attempt": s.attempt,
                "restarts": s.restarts,
                "restart_budget": s.restart_budget,
                "layout": dict(s.layout),
                "reason": s.reason,
                "blocked": list(s.blocked),
                "step": self.hang.last_step,
                "master": dict(s.master),
                "silence": {"correlated": self.silence.correlated, "episodes": self.silence.episodes},
            }
            nodes = [(n.node_id, n.role, n.slot, n.address, n.host, n.faults, n.pid) for n in s.nodes.values()]
            seen, reports = dict(self.last_seen), dict(self.reports)
        events = self.store.events(STATUS_EVENTS)
        return 200, {
            **head,
            "nodes": {
                node: {
                    "role": role,
                    "slot": slot,
                    "address": address,
                    "host": host,
                    "faults": faults,
                    "pid": pid,
                    "last_seen_s": round(now - seen.get(node, 0), 1),
                    "attempt": reports.get(node, {}).get("attempt"),
                    "ranks": [
                        {k: v for k, v in r.items() if k not in RULES_ONLY}
                        for r in reports.get(node, {}).get("ranks", [])
                    ],
                }
                for node, role, slot, address, host, faults, pid in nodes
            },
            "evicted": [node for node, role, *_ in nodes if role == EVICTED],
            "faults": [{**f, **recovery_phases(f, events)} for f in events if f["event"] == "fault"],
            "alerts": [e for e in events if e["event"] == "alert"],
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
        return 200, {"ok": True}  # the summary is written once the control loop has seen the exits out

    # ------------------------------------------------------------------ observations
    def _observe_progress(self, node_id: str, body: dict[str, Any], now: float) -> None:
        ranks = body.get("ranks", [])
        steps = [r["step"] for r in ranks if r.get("step") is not None]
        recent = self._new_step_times(ranks)
        if steps:
            before = self.hang.last_step
            self.hang.observe(max(steps), recent, now)
            if self.resumed_pending is not None and self.hang.last_step > before:
                ranks = [r for n in self.state.role(ACTIVE) for r in self.reports.get(n.node_id, {}).get("ranks", [])]
                # written by the next tick: a heartbeat's handler touches no disk (it may run on
                # the API's loop thread, api_server.Route.inline_lock)
                self.resumed_seen = {
                    **self.resumed_pending,
                    "step": self.hang.last_step,
                    "resumed": now,
                    **start_marks(ranks),
                }
                self.resumed_pending = None
        for step, seconds in recent:
            self.slow.observe(step, seconds)
        for r in ranks:
            self.straggler.observe(r["rank"], r.get("compute", []))
        rule = self.traffic.setdefault(
            node_id, TrafficRule(node_id, self.rcfg.traffic_window_s, self.rcfg.traffic_fall_ratio)
        )
        total = interface_bytes(body.get("net", {}), self.rcfg.traffic_interfaces)
        running = bool(ranks) and all(r.get("alive") for r in ranks)
        if total is not None and not body.get("net_shared"):
            finding = rule.observe(total, now, running)
            if finding is not None:
                self.errors.append(finding)

    def _new_step_times(self, ranks: list[dict[str, Any]]) -> list[tuple[int, float]]:
        """The (step, seconds) pairs the rules have not had: every heartbeat repeats each rank's
        last 16, and feeding all of them cost 128 rule updates a heartbeat at 8 ranks, not 8."""
        out: list[tuple[int, float]] = []
        for r in ranks:
            seen = self.steps_seen.get(r["rank"], -1)
            new = [(int(s), float(t)) for s, t in r.get("recent", []) if s > seen]
            if new:
                self.steps_seen[r["rank"]] = max(s for s, _ in new)
                out += new
        return out

    # ------------------------------------------------------------------ control loop
    def run(self, stop: threading.Event | None = None) -> int:
        stop = stop or threading.Event()
        while not stop.is_set():
            with self.lock:
                self._guarded_tick(time.time())
                if self.state.phase in FINISHED and not any(self.outbox.values()):
                    break
            stop.wait(TICK_S)
        if self.state.phase in FINISHED:
            self.write_summary()
        return 0 if self.state.phase == COMPLETE else 1

    def _guarded_tick(self, now: float) -> None:
        try:  # a defect no schema caught costs a tick and a logged traceback, never the job
            self.tick(now)
        except Exception as exc:
            if repr(exc) != self.tick_failure or now - self.tick_failure_logged > 60:
                log.exception("control loop tick failed; carrying on")
                self.tick_failure, self.tick_failure_logged = repr(exc), now

    def tick(self, now: float) -> None:
        self._write_resumed()
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

    def _write_resumed(self) -> None:
        """The "resumed" event a heartbeat saw, written by the control loop (the lock held)."""
        if self.resumed_seen is not None:
            seen, self.resumed_seen = self.resumed_seen, None
            self.store.event("resumed", seen, seen["resumed"])

    def _tick_starting(self, now: float) -> None:
        """O(1) until every node is in. The timeout is progress-based: it runs from the driver's
        start and from each registration, so a slow but steady registration is no failure."""
        if self.active_count >= self.state.nodes_wanted:
            self._start_attempt(now)
        elif now - self.registering_since > self.rcfg.startup_timeout_s:
            self._finish(
                FAILED,
                f"only {self.active_count} of {self.state.nodes_wanted} nodes registered: "
                f"none for {self.rcfg.startup_timeout_s:.0f} s (resilience.startup_timeout_s)",
            )

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
                return self._begin_recovery(verdict.blamed, now, others=verdict.also, collateral=verdict.collateral)
            return None
        if self._complete():
            self._finish(COMPLETE, "training complete")

    def _findings(self, now: float) -> list[Finding]:
        out = [
            Finding("heartbeat_lost", "fault", f"no heartbeat from {node} for {now - t:.1f} s", node)
            for node, t in self._lost(now)
        ]
        out += self.attempt_watch.judge(self.reports, self.state.attempt)
        all_alive = self.attempt_watch.all_alive
        out += self.errors
        self.errors = []
        hang = None if self.silence.correlated else self.hang.check(now, all_alive)
        if hang is not None:
            out.append(hang)
        slow = self.slow.check()
        if slow is not None:
            out.append(slow)
        if self.rcfg.straggler_action != "off":
            out += straggler_findings(
                self.straggler,
                self.rcfg,
                self.store,
                len(self.state.role(SPARE)),
                self.state.attempt,
                self.hang.last_step,
                now,
            )
        return out

    def _lost(self, now: float) -> list[tuple[str, float]]:
        """Nodes silent past the timeout while their peers are heard from; during a correlated
        silence none (and the hang window does not count the seconds without evidence)."""
        lost, gap = self.silence.lost(now)
        self.hang.last_progress += gap
        return lost

    def _complete(self) -> bool:
        """O(1) per tick until every node of the attempt has reported all its ranks done."""
        if not self.attempt_watch.complete:
            return False
        ranks = [r for n in self.attempt_watch.nodes for r in self.reports.get(n, {}).get("ranks", [])]
        for r in ranks:
            if r.get("exitcode") != 0:
                self.store.event(
                    "alert",
                    {
                        "kind": "exit_after_last_step",
                        "severity": "alert",
                        "detail": f"rank {r['rank']} exited with {r['exitcode']} after the last step (teardown)",
                        "rank": r["rank"],
                    },
                )
        return True

    def _alert(self, finding: Finding, now: float) -> None:
        log.warning("ALERT %s: %s", finding.kind, finding.detail)
        if finding.kind != "slow":
            return self.store.event("alert", finding.to_dict(), now)
        run_dir = self.state.run_dir
        if not self._in_background(
            "stragglers",
            lambda: self.store.event(
                "alert",
                {
                    **finding.to_dict(),
                    "stragglers": evidence.straggler_evidence(run_dir, Path(run_dir) / "config.toml"),
                },
                now,
            ),
        ):
            self.store.event(
                "alert",
                {
                    **finding.to_dict(),
                    "stragglers": None,
                    "evidence": "skipped: straggler evidence was taken moments ago",
                },
                now,
            )

    def _in_background(self, kind: str, work, limited: bool = True) -> bool:
        """Evidence reads files and imports the diagnostics (and torch): seconds that must not
        be spent holding the lock every heartbeat needs. Queued (`evidence.BackgroundQueue`):
        False when refused (a burst of one kind, or a full queue)."""
        return self.background.submit(kind, work, limited)

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
        env = {
            "WORLD_SIZE": str(len(active) * s.ranks_per_node),
            "MASTER_ADDR": s.master["addr"],
            "MASTER_PORT": str(s.master["port"]),
            "MEGASCALE_JOB_ID": s.job_id,
            "MEGASCALE_RESTART_ATTEMPT": str(s.attempt),
        }
        for node in active:
            self._send(
                node.node_id,
                "start",
                attempt=s.attempt,
                ranks=slot_ranks(node.slot, s.ranks_per_node),
                env=env,
                plan_env=self.plan_env,
                config=config,
                redis_password=password,
                keep=(keep or {}).get(node.node_id, []),
            )
        s.phase, s.attempt_started = RUNNING, now
        self.attempt_watch.watch([n.node_id for n in active])
        self.hang.reset(now)
        self.slow.reset()
        self.steps_seen = {}
        self.straggler.reset(
            {r: n.node_id for n in active for r in slot_ranks(n.slot, s.ranks_per_node)},
            s.layout,
            compute_scale(self.cfg, s.layout),
        )
        self.traffic.clear()
        self.waiting_for = {}
        checks = {command for command, _ in self.background_checks.values()}
        self.results = {c: r for c, r in self.results.items() if c in checks}  # the old attempt's are done with
        if self.current_fault is not None:
            self.resumed_pending = {"attempt": s.attempt, "fault_detected": self.current_fault["detected"]}
            self.current_fault = None
        if self.cfg.parallel.store == "redis" and s.attempt > 0:
            previous = s.attempt - 1  # bound now: the thread may run after a further restart
            if not self._in_background("rendezvous", lambda: self._clear_rendezvous(previous), limited=False):
                log.warning("attempt %d's rendezvous keys left in Redis: the background queue is full", previous)
        self.store.event(
            "attempt",
            {"attempt": s.attempt, "layout": s.layout, "master": s.master, "nodes": [n.node_id for n in active]},
            now,
        )
        log.info(
            "attempt %d: %s on %s (rendezvous %s:%d); %s",
            s.attempt,
            s.layout,
            ", ".join(n.node_id for n in active),
            s.master["addr"],
            s.master["port"],
            format_applied(self.plan_env),
        )
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
        self._save()

    def write_summary(self) -> dict[str, Any]:
        """resilience/summary.json of a finished job; never under the lock: it waits (bounded)
        for queued evidence, whose alerts belong in it."""
        if not self.background.drain(EVIDENCE_WAIT_S):
            log.warning("evidence still running after %.0f s: the summary goes without it", EVIDENCE_WAIT_S)
        s = self.state
        with self.lock:
            self._write_resumed()  # a heartbeat after the last tick may have seen the resume
        summary = self.summary()
        self.store.event("finish", summary)
        (Path(s.run_dir) / "resilience").mkdir(parents=True, exist_ok=True)
        (Path(s.run_dir) / "resilience" / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        log.log(
            logging.INFO if s.phase == COMPLETE else logging.ERROR,
            "job %s: %s (ETTR %.3f)",
            s.phase,
            s.reason,
            summary["ettr"]["ettr"],
        )
        return summary

    def _drain_exits(self, now: float) -> None:
        if now >= self.phase_deadline:
            self.outbox.clear()  # executors that never came back for their exit are gone anyway

    def summary(self) -> dict[str, Any]:
        return job_summary(self.state, self.store, self.cfg.train.steps)

    def _save(self) -> None:
        self.store.save(self.state)
