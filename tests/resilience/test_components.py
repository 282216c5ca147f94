"""Driver parts without processes: self-check plan and verdict, placement, fault specs, the
persisted state (the API's authentication: tests/security)."""

import threading
import time

import pytest

from megascale.config import load_config
from megascale.layout.grid import RankGrid
from megascale.resilience.common.rankstatus import read_status
from megascale.resilience.driver.driver import Driver
from megascale.resilience.driver.placement import PlacementError, layout_for, usable_nodes
from megascale.resilience.driver.selfcheck_plan import build, ring_rounds
from megascale.resilience.driver.state import ACTIVE, JobState, JobStore, Node
from megascale.resilience.rank.faults import StepHook, parse_faults, rank_step_hook
from megascale.resilience.selfcheck.verdict import judge


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_rounds_cover_the_ring_with_disjoint_pairs(n):
    rounds = ring_rounds(n)
    edges = {tuple(sorted(e)) for r in rounds for e in r}
    assert edges == {tuple(sorted((i, (i + 1) % n))) for i in range(n)}
    for r in rounds:
        members = [x for e in r for x in e]
        assert len(members) == len(set(members))


def _report(node, local_ok=True, pairs=()):
    tests = [{"name": "memory_bandwidth", "passed": local_ok, "value": 1.0, "unit": "GB/s", "expected": 2.0}]
    tests += [{"name": "all_reduce", "peer": p, "passed": ok} for p, ok in pairs]
    return {"ok": True, "report": {"tests": tests}}


def test_judge_names_the_node_with_the_failing_test():
    verdict = judge({"a": _report("a", pairs=[("b", True)]), "b": _report("b", False, [("a", True)])}, 0.7)
    assert list(verdict["failed"]) == ["b"] and "memory_bandwidth" in verdict["failed"]["b"]


def test_judge_blames_the_end_whose_every_link_fails():
    results = {
        "n0": _report("n0", pairs=[("n1", False), ("n2", True)]),
        "n1": None,  # cut off: no result at all
        "n2": _report("n2", pairs=[("n0", True), ("n1", False)]),
    }
    verdict = judge(results, 0.7)
    assert list(verdict["failed"]) == ["n1"]
    results["n1"] = _report("n1", pairs=[("n0", False), ("n2", False)])
    assert list(judge(results, 0.7)["failed"]) == ["n1"]


def test_judge_does_not_guess_between_two_nodes():
    verdict = judge({"a": _report("a", pairs=[("b", False)]), "b": _report("b", pairs=[("a", False)])}, 0.7)
    assert verdict["failed"] == {} and sorted(verdict["suspects"]) == ["a", "b"]


def test_plan_pairs_each_node_with_its_neighbours():
    from megascale.config.operations import ResilienceConfig

    nodes = [Node(f"n{i}", f"10.0.0.{i}", "h", ACTIVE, i) for i in range(3)]
    plans = build(nodes, 2, ResilienceConfig(rendezvous_port=30000))
    assert sorted(p["peer"] for p in plans["n0"]["pairs"]) == ["n1", "n2"]
    roles = {(p["peer"], p["role"], p["master"]) for p in plans["n1"]["pairs"]}
    assert roles == {("n0", 1, "10.0.0.0"), ("n2", 0, "10.0.0.1")}


def test_placement_shrinks_dp_and_refuses_what_cannot_fit():
    cfg = load_config(None, ["--parallel.dp=4", "--train.global_batch=8", "--train.micro_batch=2"])
    assert layout_for(cfg, 2, 2) == {"dp": 4, "tp": 1, "pp": 1, "cp": 1}
    # a cp job's layout carries cp: the slow-node rule's stages and the hang analysis's grid
    # (`evidence._hang`) are built from it, and without it covered half of the world
    cp = load_config(None, ["--parallel.dp=2", "--parallel.cp=2", "--train.global_batch=8", "--train.micro_batch=2"])
    layout = layout_for(cp, 2, 2)
    assert layout == {"dp": 2, "tp": 1, "pp": 1, "cp": 2}
    assert RankGrid(layout["pp"], layout["dp"], layout["tp"], layout["cp"]).world_size == 4
    assert layout_for(cfg, 1, 2)["dp"] == 2
    assert usable_nodes(cfg, 3, 2, 2) == 2
    cfg = load_config(
        None,
        ["--parallel.dp=2", "--parallel.tp=2", "--model.heads=4", "--train.global_batch=8", "--train.micro_batch=2"],
    )
    with pytest.raises(PlacementError, match="tp\\*pp"):
        layout_for(cfg, 1, 1)


def test_fault_specs_parse_and_fire_only_in_their_attempt(tmp_path):
    faults = parse_faults("kill:rank=1:step=6; sleep:rank=0:step=1:seconds=2.5:attempt=1")
    assert faults[0].kind == "kill" and (faults[0].rank, faults[0].step, faults[0].attempt) == (1, 6, 0)
    assert faults[1].params == {"seconds": 2.5} and faults[1].attempt == 1
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_faults("explode:rank=0:step=1")
    with pytest.raises(ValueError, match="rank= and step="):
        parse_faults("kill:step=1")
    env = {
        "MEGASCALE_FAULT": "raise:rank=0:step=2",
        "MEGASCALE_RESTART_ATTEMPT": "1",
        "MEGASCALE_STATUS_DIR": str(tmp_path),
    }
    assert StepHook(0, env).faults == {}
    env["MEGASCALE_RESTART_ATTEMPT"] = "0"
    assert list(StepHook(0, env).faults) == [2]


def test_a_rank_gets_a_step_hook_only_when_asked(tmp_path):
    """Training outside an executor and fault tests runs no per-step hook at all."""
    assert rank_step_hook(0, {}) is None
    hook = rank_step_hook(3, {"MEGASCALE_STATUS_DIR": str(tmp_path)})
    hook(7, 0.25)
    assert read_status(tmp_path, 3)["step"] == 7 and not hook.faults
    assert rank_step_hook(0, {"MEGASCALE_FAULT": "exit:rank=0:step=9"}).faults[9].kind == "exit"


def test_state_survives_a_new_store(tmp_path):
    store = JobStore(tmp_path / "s.sqlite")
    state = JobState("j1", 2, 2, {"dp": 4, "tp": 1, "pp": 1}, run_dir=str(tmp_path))
    state.nodes["n0"] = Node("n0", "10.0.0.1", "h", ACTIVE, 0, faults=1)
    state.blocked.append("10.0.0.9")
    state.attempt, state.restarts = 3, 2
    store.save(state)
    store.event("fault", {"kind": "hang"})
    store.close()
    again = JobStore(tmp_path / "s.sqlite")
    loaded = again.load()
    assert loaded == state and isinstance(loaded.nodes["n0"], Node)
    assert [(e["event"], e["kind"]) for e in again.events("fault")] == [("fault", "hang")]


def test_bad_resilience_config_names_the_key():
    from megascale.config import ConfigError

    with pytest.raises(ConfigError, match="resilience.heartbeat_timeout_s"):
        load_config(None, ["--resilience.heartbeat_s=5", "--resilience.heartbeat_timeout_s=2"])
    with pytest.raises(ConfigError, match="resilience.restart_budget"):
        load_config(None, ["--resilience.restart_budget=-1"])


def test_a_tick_that_raises_is_logged_once_and_the_control_loop_goes_on(tmp_path, caplog):
    """The issue's crash ("ranks": "abc" reaching the rules), planted past the schemas: the
    driver logs it and keeps ticking; once the report is sane again the job carries on."""
    cfg = load_config(None, ["--parallel.dp=1", "--train.steps=10"])
    state = JobState("j1", 1, 1, {"dp": 1, "tp": 1, "pp": 1}, run_dir=str(tmp_path))
    driver = Driver(cfg, state, JobStore(tmp_path / "s.sqlite"))
    driver.on_register({"node_id": "n0", "address": "127.0.0.1", "host": "h", "pid": None})
    driver.tick(time.time())
    assert state.phase == "running"
    driver.reports["n0"] = {"attempt": 0, "ranks": "abc"}
    driver.attempt_watch.fresh.add("n0")  # as a heartbeat marks its report for the next tick
    stop = threading.Event()
    loop = threading.Thread(target=driver.run, args=(stop,), daemon=True)
    loop.start()
    time.sleep(1.0)  # four ticks, each failing the same way
    assert loop.is_alive() and caplog.text.count("control loop tick failed") == 1
    with driver.lock:
        driver.reports["n0"] = {"attempt": 0, "ranks": [{"rank": 0, "alive": False, "exitcode": 0, "step": 10}]}
        driver.attempt_watch.fresh.add("n0")
    deadline = time.monotonic() + 5
    while state.phase != "complete" and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    loop.join(5)
    assert state.phase == "complete" and not loop.is_alive()
