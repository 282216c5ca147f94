"""Fault attribution on the evidence executors really send: the first rank to die is blamed, a
peer that then dies of the collective error is collateral, and only the blamed node's fault
count grows (issue 25, item 8). The decision function, then the driver's control loop in-process."""

from __future__ import annotations

import json
import time

from pydantic import BaseModel

from megascale.config import load_config
from megascale.resilience.common import protocol
from megascale.resilience.driver.attribution import attribute
from megascale.resilience.driver.driver import Driver
from megascale.resilience.driver.rules import Finding, abnormal_exits, error_lines
from megascale.resilience.driver.state import JobState, JobStore

T0 = 1_800_000_000.0
KEYWORDS = ["Traceback (most recent call last)"]


def rank(number: int, exitcode: int | None = None, exited_at: float | None = None) -> dict:
    return {
        "rank": number,
        "local_rank": number % 2,
        "pid": 1000 + number,
        "alive": exitcode is None,
        "exitcode": exitcode,
        "exited_at": exited_at,
        "step": 6,
    }


def report(node: str, at: float, ranks: list[dict], errors: list[dict] = ()) -> dict:
    return {"node_id": node, "time": at, "attempt": 0, "ranks": ranks, "errors": list(errors)}


def via_api(schema: type[BaseModel], body: dict) -> dict:
    """The body as the API hands it to a handler: checked and completed by its schema."""
    return schema.model_validate_json(json.dumps(body)).model_dump()


def findings(reports: dict[str, dict]) -> list[Finding]:
    out: list[Finding] = []
    for node, r in reports.items():
        out += abnormal_exits(node, r["ranks"]) + error_lines(node, r["errors"], KEYWORDS)
    return out


# rank 1 (node0) is SIGKILLed at T0; gloo fails on every peer, which exit 1 within ~0.3 s
# and print a traceback; node1's heartbeat arrives first.
NODE1_FIRST = report(
    "node1",
    T0 + 0.5,
    [rank(2, 1, T0 + 0.15), rank(3, 1, T0 + 0.3)],
    [{"rank": 2, "text": "Traceback (most recent call last):"}],
)
NODE0_BEFORE = report("node0", T0 - 0.1, [rank(0), rank(1)])
NODE0_AFTER = report("node0", T0 + 0.9, [rank(0, 1, T0 + 0.2), rank(1, -9, T0)])


def test_no_verdict_until_every_node_has_reported_after_the_first_death():
    reports = {"node0": NODE0_BEFORE, "node1": NODE1_FIRST}
    assert attribute(findings(reports), reports, waited_enough=False) is None


def test_the_killed_rank_is_blamed_and_its_peers_are_collateral():
    reports = {"node0": NODE0_AFTER, "node1": NODE1_FIRST}
    verdict = attribute(findings(reports), reports, waited_enough=False)
    assert (verdict.blamed.node, verdict.blamed.rank, verdict.blamed.kind) == ("node0", 1, "abnormal_exit")
    assert "killed by signal 9" in verdict.blamed.detail
    assert sorted((f.rank, f.kind) for f in verdict.collateral) == [
        (0, "abnormal_exit"),
        (2, "abnormal_exit"),
        (2, "error_keyword"),
        (3, "abnormal_exit"),
    ]
    assert verdict.also == []


def test_an_exception_is_blamed_by_time_when_everyone_exits_1():
    reports = {
        "node0": report("node0", T0 + 1, [rank(0, 1, T0 + 0.2), rank(1, 1, T0 + 0.25)]),
        "node1": report("node1", T0 + 1, [rank(2, 1, T0), rank(3, 1, T0 + 0.3)]),
    }
    verdict = attribute(findings(reports), reports, waited_enough=False)
    assert (verdict.blamed.node, verdict.blamed.rank) == ("node1", 2)
    assert len(verdict.collateral) == 3


def test_without_exit_times_a_signal_death_wins_and_a_second_kill_is_not_collateral():
    reports = {
        "node0": report("node0", T0 + 1, [rank(0, 1), rank(1, -9)]),
        "node1": report("node1", T0 + 1, [rank(2, -9), rank(3, 1)]),
    }
    verdict = attribute(findings(reports), reports, waited_enough=False)
    assert (verdict.blamed.node, verdict.blamed.rank) == ("node0", 1)
    assert [(f.node, f.rank) for f in verdict.also] == [("node1", 2)]
    assert sorted(f.rank for f in verdict.collateral) == [0, 3]


def test_a_silent_node_is_not_waited_for_once_it_is_lost():
    lost = Finding("heartbeat_lost", "fault", "no heartbeat from node0 for 4.5 s", "node0")
    reports = {"node0": NODE0_BEFORE, "node1": NODE1_FIRST}
    verdict = attribute([*findings(reports), lost], reports, waited_enough=False)
    assert verdict.blamed == lost and len(verdict.collateral) == 3


def test_the_driver_blames_and_counts_only_the_first_death(tmp_path):
    """max_node_faults=1: blaming the collateral node would evict a healthy node."""
    cfg = load_config(None, ["--parallel.dp=4", "--train.steps=16", "--resilience.max_node_faults=1"])
    state = JobState(
        job_id="j", nodes_wanted=2, ranks_per_node=2, layout={"dp": 4, "tp": 1, "pp": 1}, run_dir=str(tmp_path)
    )
    driver = Driver(cfg, state, JobStore(tmp_path / "driver.sqlite"))
    driver.rcfg.error_keywords = KEYWORDS
    for node, address in (("node0", "10.0.0.1"), ("node1", "10.0.0.2")):
        assert (
            driver.on_register(via_api(protocol.Register, {"node_id": node, "address": address, "host": node}))[0]
            == 200
        )
    now = time.time()
    driver.tick(now)
    assert state.phase == "running"
    driver.on_heartbeat(via_api(protocol.Heartbeat, NODE0_BEFORE))
    driver.on_heartbeat(via_api(protocol.Heartbeat, NODE1_FIRST))
    driver.tick(now + 0.25)
    assert state.phase == "running"  # node0's evidence is not in yet
    driver.on_heartbeat(via_api(protocol.Heartbeat, NODE0_AFTER))
    driver.tick(now + 0.5)
    assert state.phase == "stopping"
    fault = driver.store.events("fault")[-1]
    assert (fault["node"], fault["rank"]) == ("node0", 1)
    assert {(f["node"], f["rank"]) for f in fault["collateral"]} == {("node0", 0), ("node1", 2), ("node1", 3)}
    assert (state.nodes["node0"].faults, state.nodes["node1"].faults) == (1, 0)
