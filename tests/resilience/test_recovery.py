"""Recovery decisions and bookkeeping without processes (issue 20): the self-check rule, the path
rule, each recovery's phases, and the driver's control loop driven in-process by heartbeats as
the executors send them."""

from __future__ import annotations

import json
import time

import pytest

from megascale.config import load_config
from megascale.diagnostics.report import recovery_rows
from megascale.resilience.common import protocol
from megascale.resilience.driver.decide import IN_PLACE, RESTART, CheckDecision, recovery_path, selfcheck_decision
from megascale.resilience.driver.driver import Driver
from megascale.resilience.driver.ettr import job_summary
from megascale.resilience.driver.recovery import recovery_phases
from megascale.resilience.driver.state import JobState, JobStore
from tests.resilience.test_attribution import via_api

KILLED = {"kind": "abnormal_exit", "node": "node0", "rank": 1, "detail": "rank 1 on node0: killed by signal 9"}


@pytest.mark.parametrize(
    ("fault", "faults", "runs", "rule"),
    [
        (KILLED, 1, False, "process fault"),
        (
            {
                "kind": "error_keyword",
                "node": "node1",
                "rank": 2,
                "detail": "rank 2 on node1 logged 'Traceback (most recent call last)': ...",
            },
            1,
            False,
            "process fault",
        ),
        (
            {"kind": "heartbeat_lost", "node": "node1", "detail": "no heartbeat from node1 for 4.1 s"},
            1,
            True,
            "heartbeats",
        ),
        ({"kind": "traffic_zero", "node": "node1", "detail": "no traffic"}, 1, True, "traffic"),
        (
            {
                "kind": "error_keyword",
                "node": "node1",
                "rank": 2,
                "detail": "rank 2 on node1 logged 'NCCL error': NCCL error in: ... unhandled system error",
            },
            1,
            True,
            "transport",
        ),
        ({"kind": "hang", "detail": "no step progress for 5.2 s"}, 0, True, "may be the network"),
        (
            {
                "kind": "hang",
                "detail": "no step progress",
                "culprits": [{"node": "node1", "rank": 3, "state": "stopped"}],
            },
            0,
            False,
            "stopped or gone",
        ),
        (KILLED, 2, True, "repeated faults"),
        ({**KILLED, "limit": 10}, 2, False, "process fault"),  # with max_node_faults=10 only the 9th is "repeated"
        ({**KILLED, "limit": 10}, 9, True, "repeated faults"),
        ({**KILLED, "also": [{"kind": "heartbeat_lost", "node": "node1", "detail": "..."}]}, 1, True, "heartbeats"),
    ],
)
def test_selfcheck_runs_only_when_the_evidence_points_at_the_machine(fault, faults, runs, rule):
    decision = selfcheck_decision(fault, faults, max_node_faults=fault.get("limit", 2))
    assert decision.run is runs and rule in decision.rule, decision
    assert decision.inputs["kind"] == fault["kind"] and decision.inputs["node_faults"] == faults
    assert ("runs" if runs else "skipped") in decision.describe()


NODES = {"node0": 0, "node1": 1}
SKIP = CheckDecision(False, "process fault")


def path(fault, check=SKIP, spares=("node2",), live=("node0", "node1", "node2"), **kw):
    args = {
        "enabled": True,
        "fault": fault,
        "check": check,
        "slots": NODES,
        "spares": list(spares),
        "ranks_per_node": 2,
        "node_faults": {},
        "max_node_faults": 2,
        "live": set(live),
    } | kw
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
    hang = {
        "kind": "hang",
        "node": None,
        "rank": None,
        "detail": "no progress",
        "culprits": [{"node": "node1", "rank": 3, "state": "stopped"}],
    }
    decision = path(hang, selfcheck_decision(hang, 0, 2))
    assert decision.path == IN_PLACE and decision.replaced == {3: "node1"}


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"enabled": False}, "in_place is off"),
        ({"fault": {"kind": "hang", "node": None, "rank": None, "detail": ""}}, "no node is blamed"),
        (
            {"fault": {"kind": "heartbeat_lost", "node": "node1", "rank": None, "detail": ""}, "spares": ()},
            "layout would change",
        ),
        ({"live": ("node0", "node2")}, "not reporting"),
    ],
)
def test_the_fast_path_falls_back_to_restarting_everything_and_says_why(kwargs, why):
    decision = path(kwargs.pop("fault", KILLED), **kwargs)
    assert decision.path == RESTART and why in decision.reason


def test_phases_of_a_recovery_come_from_the_events():
    fault = {"event": "fault", "time": 100.0, "attempt": 2, "detected": 100.0, "last_progress": 99.5}
    events = [
        fault,
        {"event": "stopped", "time": 100.4, "attempt": 2},
        {"event": "decide", "time": 100.5, "attempt": 2, "path": IN_PLACE, "reason": "r", "selfcheck": {"run": False}},
        {
            "event": "resumed",
            "time": 103.0,
            "fault_detected": 100.0,
            "resumed": 103.0,
            "joined": 101.5,
            "restored": 102.0,
            "source": "memory",
            "restore_step": 8,
        },
    ]
    phases = recovery_phases(fault, events)
    assert phases["path"] == IN_PLACE and phases["restore_source"] == "memory" and phases["restore_step"] == 8
    got = {k: round(phases[f"{k}_s"], 3) for k in ("detect", "stop", "decide", "replace", "restore", "first_step")}
    assert got == {"detect": 0.5, "stop": 0.4, "decide": 0.1, "replace": 1.0, "restore": 0.5, "first_step": 1.0}
    assert phases["recovery_s"] == 3.0 and phases["selfcheck_s"] is None


# ---------------------------------------------------------------------- the driver, in-process
def heartbeat(node: str, at: float, ranks: list[dict], attempt: int = 0, done: dict | None = None) -> dict:
    return via_api(
        protocol.Heartbeat, {"node_id": node, "time": at, "attempt": attempt, "ranks": ranks, "done": done or {}}
    )


def rank(number: int, step: int = 6, exitcode: int | None = None, exited_at: float | None = None, **more) -> dict:
    return {
        "rank": number,
        "local_rank": number % 2,
        "pid": 1000 + number,
        "alive": exitcode is None,
        "exitcode": exitcode,
        "exited_at": exited_at,
        "step": step,
        **more,
    }


def started_driver(tmp_path, *flags: str) -> tuple[Driver, float]:
    cfg = load_config(None, ["--parallel.dp=4", "--train.steps=16", "--resilience.spares=0", *flags])
    state = JobState(
        job_id="j", nodes_wanted=2, ranks_per_node=2, layout={"dp": 4, "tp": 1, "pp": 1}, run_dir=str(tmp_path)
    )
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
    rank_1_killed(driver, now)
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
    assert driver.store.events("resumed") == []  # a heartbeat writes nothing: the next tick does
    driver.tick(now + 7.1)
    fault = job_summary(driver.state, driver.store, 16)["faults"][0]
    assert fault["path"] == RESTART and fault["restore_source"] == "storage" and fault["restore_step"] == 4
    assert fault["replace_s"] == pytest.approx(now + 5 - decided["time"]) and fault["restore_s"] == pytest.approx(1.0)
    rows = recovery_rows(_summary_file(tmp_path, driver))
    assert rows[0]["path"] == RESTART and rows[0]["check"] == "skipped" and rows[0]["source"] == "storage"


def test_a_lost_node_still_gets_the_selfcheck(tmp_path):
    driver, now = started_driver(tmp_path, "--resilience.in_place=false")
    driver.on_heartbeat(heartbeat("node0", now + 1, [rank(0), rank(1)]))
    driver.last_seen["node0"] = now + 5.5  # heard from lately, on the test's clock
    driver.tick(now + 6)  # node1 silent for longer than heartbeat_timeout_s (5 s)
    assert driver.state.phase == "stopping"
    answer_phase(driver, now + 6.5, {"ok": True, "stopped": 2})
    driver.tick(now + 6.6)
    assert driver.state.phase == "checking"


def _summary_file(tmp_path, driver: Driver):
    (tmp_path / "resilience").mkdir(exist_ok=True)
    (tmp_path / "resilience" / "summary.json").write_text(json.dumps(driver.summary(), default=str))
    return tmp_path


def commands(driver: Driver, kind: str) -> dict[str, dict]:
    return {node: c for node, box in driver.outbox.items() for c in box if c["kind"] == kind}


def answer(driver: Driver, at: float, results: dict[str, dict]) -> None:
    for node, result in results.items():
        driver.on_heartbeat(heartbeat(node, at, [], done={driver.waiting_for[node]: result}))


def fast_driver(tmp_path) -> tuple[Driver, float]:
    driver, now = started_driver(tmp_path, "--resilience.in_place=true")
    driver.on_register(via_api(protocol.Register, {"node_id": "node2", "address": "10.0.0.3", "host": "node2"}))
    assert driver.state.nodes["node2"].role == "spare"
    return driver, now


def rank_1_killed(driver: Driver, now: float) -> None:
    """Rank 1 (node 0) dies by SIGKILL; both nodes report it; the driver acts on it."""
    driver.on_heartbeat(heartbeat("node0", now + 1, [rank(0), rank(1, exitcode=-9, exited_at=now + 0.5)]))
    driver.on_heartbeat(heartbeat("node1", now + 1, [rank(2), rank(3)]))
    driver.tick(now + 1.1)


def test_a_killed_rank_is_replaced_and_the_others_rejoin(tmp_path):
    driver, now = fast_driver(tmp_path)
    spare = driver.on_heartbeat(heartbeat("node2", now, []))[1]
    assert (spare["standby"], spare["heartbeat_s"]) == (0, 1.0)  # no imports beside the job's start
    driver.on_heartbeat(heartbeat("node0", now + 0.5, [rank(0), rank(1)]))
    assert driver.on_heartbeat(heartbeat("node2", now, []))[1]["standby"] == 2  # trains: one warm rank per rank
    rank_1_killed(driver, now)
    assert driver.state.phase == "recovering"
    assert driver.on_heartbeat(heartbeat("node1", now + 1.2, [rank(2), rank(3)]))[1]["heartbeat_s"] == 0.2
    pauses = commands(driver, "pause")
    assert (pauses["node0"]["kill"], pauses["node1"]["kill"]) == ([1], []) and "node2" not in pauses
    # rank 3 died meanwhile: it is replaced too, where it was
    answer(
        driver,
        now + 2,
        {"node0": {"ok": True, "paused": [0], "dead": [1]}, "node1": {"ok": True, "paused": [2], "dead": [3]}},
    )
    driver.tick(now + 2.1)
    assert driver.state.phase == "running" and driver.state.attempt == 1 and driver.state.restarts == 1
    starts = commands(driver, "start")
    assert (starts["node0"]["keep"], starts["node1"]["keep"]) == ([0], [2]) and "node2" not in starts
    decided = driver.store.events("decide")[-1]
    assert decided["path"] == IN_PLACE and decided["replaced"] == {"1": "node0", "3": "node1"}
    assert driver.store.events("selfcheck") == []  # a killed process is no hardware symptom
    shown = driver.on_status({})[1]["faults"][0]  # the API shows the recovery as it goes
    assert shown["path"] == IN_PLACE and shown["stop_s"] == pytest.approx(1.0) and shown["resumed"] is None


def test_a_lost_node_s_slot_goes_to_the_spare_and_a_silent_survivor_means_a_restart(tmp_path):
    driver, now = fast_driver(tmp_path)
    driver.on_heartbeat(heartbeat("node0", now + 1, [rank(0), rank(1)]))
    driver.on_heartbeat(heartbeat("node2", now + 1, []))
    driver.last_seen.update(node0=now + 5.5, node2=now + 5.5)  # heard from lately, on the test's clock
    driver.tick(now + 6)  # node1 silent for longer than heartbeat_timeout_s
    assert driver.state.phase == "recovering" and set(commands(driver, "pause")) == {"node0"}
    answer(driver, now + 6.5, {"node0": {"ok": True, "paused": [0, 1], "dead": []}})
    driver.tick(now + 6.6)
    nodes = driver.state.nodes
    assert (nodes["node2"].role, nodes["node2"].slot, nodes["node1"].role) == ("active", 1, "evicted")
    starts = commands(driver, "start")
    assert starts["node0"]["keep"] == [0, 1] and starts["node2"]["keep"] == [] and starts["node2"]["ranks"] == [2, 3]

    driver2, now = fast_driver(tmp_path / "again")
    rank_1_killed(driver2, now)
    answer(driver2, now + 2, {"node0": {"ok": True, "paused": [0], "dead": [1]}})
    driver2.tick(now + 30)  # node1 never answered its pause: its ranks' state is unknown
    assert driver2.state.phase == "stopping"
    assert "node1 did not answer the pause" in driver2.current_fault["path_reason"]


def test_a_transport_error_takes_the_node_out_for_a_selfcheck_beside_the_job(tmp_path):
    driver, now = fast_driver(tmp_path)
    line = {"rank": 2, "text": "NCCL error in: ProcessGroupNCCL.cpp: unhandled system error"}
    driver.on_heartbeat(heartbeat("node0", now + 1, [rank(0), rank(1)]))
    driver.on_heartbeat(
        via_api(
            protocol.Heartbeat,
            {"node_id": "node1", "time": now + 1, "attempt": 0, "ranks": [rank(2), rank(3)], "errors": [line]},
        )
    )
    driver.on_heartbeat(heartbeat("node2", now + 1, []))
    driver.tick(now + 1.5)
    assert driver.state.phase == "recovering" and commands(driver, "pause")["node1"]["kill"] == [2, 3]
    answer(
        driver,
        now + 2,
        {"node0": {"ok": True, "paused": [0, 1], "dead": []}, "node1": {"ok": True, "paused": [], "dead": [2, 3]}},
    )
    driver.tick(now + 2.1)
    assert driver.state.nodes["node1"].role == "suspect" and driver.state.nodes["node2"].role == "active"
    check = commands(driver, "selfcheck")["node1"]
    assert check["plan"]["pairs"] == []  # its local tests, while the job trains on
    report = {"node": "node1", "host": "node1", "pid": 1, "passed": True, "tests": []}
    driver.on_heartbeat(heartbeat("node1", now + 3, [], done={check["id"]: {"ok": True, "report": report}}))
    driver.tick(now + 3.1)
    assert driver.state.nodes["node1"].role == "spare"
    assert driver.store.events("selfcheck")[-1]["background"] is True


def test_a_driver_restarted_during_a_fast_recovery_restarts_every_rank(tmp_path):
    driver, now = fast_driver(tmp_path)
    rank_1_killed(driver, now)
    assert driver.state.phase == "recovering"
    again = Driver(driver.cfg, JobStore(tmp_path / "driver.sqlite").load(), driver.store)
    assert again.state.phase == "stopping" and "driver restarted" in again.current_fault["path_reason"]
