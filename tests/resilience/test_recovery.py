"""Recovery decisions and bookkeeping without processes (issue 20): the self-check rule, the path
rule, each recovery's phases, and the driver's control loop driven in-process by heartbeats as
the executors send them."""

from __future__ import annotations

import json
import time

import pytest

from megascale.config import load_config
from megascale.diagnostics.report import recovery_rows
from megascale.resilience import protocol
from megascale.resilience.decide import IN_PLACE, RESTART, CheckDecision, recovery_path, selfcheck_decision
from megascale.resilience.driver import Driver
from megascale.resilience.ettr import job_summary
from megascale.resilience.recovery import recovery_phases
from megascale.resilience.state import JobState, JobStore
from tests.resilience.test_attribution import via_api

KILLED = {"kind": "abnormal_exit", "node": "node0", "rank": 1, "detail": "rank 1 on node0: killed by signal 9"}


@pytest.mark.parametrize(("fault", "faults", "runs", "rule"), [
    (KILLED, 1, False, "process fault"),
    ({"kind": "error_keyword", "node": "node1", "rank": 2,
      "detail": "rank 2 on node1 logged 'Traceback (most recent call last)': ..."}, 1, False, "process fault"),
    ({"kind": "heartbeat_lost", "node": "node1", "detail": "no heartbeat from node1 for 4.1 s"}, 1, True, "heartbeats"),
    ({"kind": "traffic_zero", "node": "node1", "detail": "no traffic"}, 1, True, "traffic"),
    ({"kind": "error_keyword", "node": "node1", "rank": 2,
      "detail": "rank 2 on node1 logged 'NCCL error': NCCL error in: ... unhandled system error"}, 1, True,
     "transport"),
    ({"kind": "hang", "detail": "no step progress for 5.2 s"}, 0, True, "may be the network"),
    ({"kind": "hang", "detail": "no step progress", "culprits": [{"node": "node1", "rank": 3, "state": "stopped"}]},
     0, False, "stopped or gone"),
    (KILLED, 2, True, "repeated faults"),
    ({**KILLED, "also": [{"kind": "heartbeat_lost", "node": "node1", "detail": "..."}]}, 1, True, "heartbeats"),
])
def test_selfcheck_runs_only_when_the_evidence_points_at_the_machine(fault, faults, runs, rule):
    decision = selfcheck_decision(fault, faults, max_node_faults=2)
    assert decision.run is runs and rule in decision.rule, decision
    assert decision.inputs["kind"] == fault["kind"] and decision.inputs["node_faults"] == faults
    assert ("runs" if runs else "skipped") in decision.describe()


NODES = {"node0": 0, "node1": 1}
SKIP = CheckDecision(False, "process fault")


def path(fault, check=SKIP, spares=("node2",), live=("node0", "node1", "node2"), **kw):
    args = {"enabled": True, "resumed_driver": False, "fault": fault, "check": check, "slots": NODES,
            "spares": list(spares), "ranks_per_node": 2, "node_faults": {}, "max_node_faults": 2,
            "live": set(live)} | kw
    return recovery_path(**args)


def test_a_killed_rank_is_replaced_on_its_own_node_and_everyone_else_stays():
    decision = path(KILLED)
    assert decision.path == IN_PLACE and decision.replaced == {1: "node0"} and decision.leaving == []


def test_two_ranks_on_two_nodes_are_both_replaced_in_place():
    decision = path({**KILLED, "also": [{"kind": "abnormal_exit", "node": "node1", "rank": 2, "detail": ""}]})
    assert decision.path == IN_PLACE and decision.replaced == {1: "node0", 2: "node1"}


def test_a_lost_node_is_replaced_by_the_spare_and_checked_meanwhile():
    lost = {"kind": "heartbeat_lost", "node": "node1", "rank": None, "detail": "no heartbeat"}
    decision = path(lost, selfcheck_decision(lost, 1, 2), live=("node0", "node2"))
    assert decision.path == IN_PLACE and decision.leaving == ["node1"] and decision.spares_in == ["node2"]
    assert decision.replaced == {2: "node2", 3: "node2"}


def test_a_stopped_process_is_the_hang_s_culprit():
    hang = {"kind": "hang", "node": None, "rank": None, "detail": "no progress",
            "culprits": [{"node": "node1", "rank": 3, "state": "stopped"}]}
    decision = path(hang, selfcheck_decision(hang, 0, 2))
    assert decision.path == IN_PLACE and decision.replaced == {3: "node1"}


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"enabled": False}, "in_place is off"),
    ({"resumed_driver": True}, "driver restarted"),
    ({"fault": {"kind": "hang", "node": None, "rank": None, "detail": ""}}, "no node is blamed"),
    ({"fault": {"kind": "heartbeat_lost", "node": "node1", "rank": None, "detail": ""}, "spares": ()},
     "layout would change"),
    ({"live": ("node0", "node2")}, "not reporting"),
])
def test_the_fast_path_falls_back_to_restarting_everything_and_says_why(kwargs, why):
    decision = path(kwargs.pop("fault", KILLED), **kwargs)
    assert decision.path == RESTART and why in decision.reason


def test_phases_of_a_recovery_come_from_the_events():
    fault = {"event": "fault", "time": 100.0, "attempt": 2, "detected": 100.0, "last_progress": 99.5}
    events = [fault,
              {"event": "stopped", "time": 100.4, "attempt": 2},
              {"event": "decide", "time": 100.5, "attempt": 2, "path": IN_PLACE, "reason": "r",
               "selfcheck": {"run": False}},
              {"event": "resumed", "time": 103.0, "fault_detected": 100.0, "resumed": 103.0, "joined": 101.5,
               "restored": 102.0, "source": "memory", "restore_step": 8}]
    phases = recovery_phases(fault, events)
    assert phases["path"] == IN_PLACE and phases["restore_source"] == "memory" and phases["restore_step"] == 8
    got = {k: round(phases[f"{k}_s"], 3) for k in ("detect", "stop", "decide", "replace", "restore", "first_step")}
    assert got == {"detect": 0.5, "stop": 0.4, "decide": 0.1, "replace": 1.0, "restore": 0.5, "first_step": 1.0}
    assert phases["recovery_s"] == 3.0 and phases["selfcheck_s"] is None


# ---------------------------------------------------------------------- the driver, in-process
def heartbeat(node: str, at: float, ranks: list[dict], attempt: int = 0, done: dict | None = None) -> dict:
    return via_api(protocol.Heartbeat, {"node_id": node, "time": at, "attempt": attempt, "ranks": ranks,
                                        "done": done or {}})


def rank(number: int, step: int = 6, exitcode: int | None = None, exited_at: float | None = None, **more) -> dict:
    return {"rank": number, "local_rank": number % 2, "pid": 1000 + number, "alive": exitcode is None,
            "exitcode": exitcode, "exited_at": exited_at, "step": step, **more}


def started_driver(tmp_path, *flags: str) -> tuple[Driver, float]:
    cfg = load_config(None, ["--parallel.dp=4", "--train.steps=16", "--resilience.spares=0", *flags])
    state = JobState(job_id="j", nodes_wanted=2, ranks_per_node=2, layout={"dp": 4, "tp": 1, "pp": 1},
                     run_dir=str(tmp_path))
    driver = Driver(cfg, state, JobStore(tmp_path / "driver.sqlite"))
    for node, address in (("node0", "10.0.0.1"), ("node1", "10.0.0.2")):
        driver.on_register(via_api(protocol.Register, {"node_id": node, "address": address, "host": node}))
    now = time.time()
    driver.tick(now)
    assert state.phase == "running"
    return driver, now


def answer_phase(driver: Driver, at: float, result: dict) -> None:
    """Every node acknowledges the command the driver is waiting on."""
    for node, command in driver.waiting_for.items():
        driver.on_heartbeat(heartbeat(node, at, [], done={command: result}))


def test_a_killed_process_restarts_without_a_selfcheck_and_the_phases_are_recorded(tmp_path):
    driver, now = started_driver(tmp_path, "--resilience.in_place=false")
    driver.on_heartbeat(heartbeat("node0", now + 1, [rank(0), rank(1, exitcode=-9, exited_at=now + 0.5)]))
    driver.on_heartbeat(heartbeat("node1", now + 1, [rank(2), rank(3)]))
    driver.tick(now + 1.1)
    assert driver.state.phase == "stopping"
    answer_phase(driver, now + 2, {"ok": True, "stopped": 2})
    driver.tick(now + 2.1)
    assert driver.state.phase == "running" and driver.state.attempt == 1  # no CHECKING in between
    decided = driver.store.events("decide")[-1]
    assert decided["path"] == RESTART and "in_place is off" in decided["reason"]
    assert decided["selfcheck"]["run"] is False and "process fault" in decided["selfcheck"]["rule"]
    assert driver.store.events("selfcheck") == []
    start = {"joined_at": now + 5, "restored_at": now + 6, "source": "storage", "step": 4}
    for node, ranks in (("node0", (0, 1)), ("node1", (2, 3))):
        driver.on_heartbeat(heartbeat(node, now + 7, [rank(r, step=5, start=start) for r in ranks], attempt=1))
    fault = job_summary(driver.state, driver.store, 16)["faults"][0]
    assert fault["path"] == RESTART and fault["restore_source"] == "storage" and fault["restore_step"] == 4
    assert fault["replace_s"] == pytest.approx(now + 5 - decided["time"]) and fault["restore_s"] == pytest.approx(1.0)
    rows = recovery_rows(_summary_file(tmp_path, driver))
    assert rows[0]["path"] == RESTART and rows[0]["check"] == "skipped" and rows[0]["source"] == "storage"


def test_a_lost_node_still_gets_the_selfcheck(tmp_path):
    driver, now = started_driver(tmp_path, "--resilience.in_place=false")
    driver.on_heartbeat(heartbeat("node0", now + 1, [rank(0), rank(1)]))
    driver.tick(now + 6)  # node1 silent for longer than heartbeat_timeout_s (5 s)
    assert driver.state.phase == "stopping"
    answer_phase(driver, now + 6.5, {"ok": True, "stopped": 2})
    driver.tick(now + 6.6)
    assert driver.state.phase == "checking"


def _summary_file(tmp_path, driver: Driver):
    (tmp_path / "resilience").mkdir(exist_ok=True)
    (tmp_path / "resilience" / "summary.json").write_text(json.dumps(driver.summary(), default=str))
    return tmp_path
