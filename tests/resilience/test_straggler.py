"""The fail-slow rule (`straggler_rule.py`) on synthetic compute times, and the driver acting on it.

Pure logic and an in-process driver: no processes (the real slowed node is in test_fail_slow.py).
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from megascale.config import load_config
from megascale.diagnostics.report import detection_rows
from megascale.resilience.common import protocol
from megascale.resilience.driver.straggler_rule import (
    KEEP,
    StragglerRule,
    action_for,
    median_without,
    straggler_rule,
)
from tests.resilience.test_recovery import _summary_file, answer, commands, fast_driver, heartbeat, rank, via_api

W, WINDOWS, WARMUP = 4, 2, 2


def rule(nodes: int = 4, per_node: int = 2, layout: dict | None = None, threshold: float = 1.3) -> StragglerRule:
    r = StragglerRule(threshold, WINDOWS, W, WARMUP)
    r.reset(
        {k: f"node{k // per_node}" for k in range(nodes * per_node)},
        layout or {"dp": nodes * per_node, "tp": 1, "pp": 1},
    )
    return r


def feed(r: StragglerRule, steps: range, compute, per_beat: int = 3) -> list:
    """Heartbeats of every rank carrying the last 16 (step, compute) pairs, every `per_beat` steps."""
    found, history = [], {k: [] for k in r.ranks}
    for step in steps:
        for k in r.ranks:
            history[k] = [*history[k][-15:], (step, compute(k, step))]
        if step % per_beat == 0:
            for k in r.ranks:
                r.observe(k, history[k])
            found += r.check()
    return found


def test_a_node_slowed_2x_is_named_within_the_bound_with_its_evidence():
    r = rule()
    slow_from = 11
    found = feed(r, range(1, 60), lambda k, s: 0.2 if k in (2, 3) and s >= slow_from else 0.1)
    assert [d.kind for d in found] == ["straggler"]
    d = found[0]
    assert d.node == "node1" and d.ranks == [2, 3] and d.ratio == pytest.approx(2.0)
    assert d.compute_s == pytest.approx(0.2) and d.peers_median_s == pytest.approx(0.1)
    assert d.cost == pytest.approx(0.5) and d.windows == WINDOWS
    # the bound: the windows after the slowdown began, plus the one it began in (W - 1 steps)
    assert slow_from <= d.steps[1] <= slow_from + WINDOWS * W + W - 1
    assert "node1" in d.describe() and "50%" in d.describe()


def test_jitter_of_20_percent_on_every_rank_over_a_long_soak_is_never_flagged():
    """+-20% uniform noise on each rank's every step, 16 ranks, 4000 steps (1000 windows)."""
    noise = random.Random(7)
    r = rule(nodes=8)
    found = feed(r, range(1, 4000), lambda k, s: 0.1 * noise.uniform(0.8, 1.2))
    assert found == []
    assert r.judged > 900  # it really judged the windows


def test_a_slowdown_every_rank_shares_names_no_node_and_says_the_job_is_the_cause():
    r = rule()
    found = feed(r, range(1, 60), lambda k, s: 0.15 if s >= 20 else 0.1)
    assert [d.kind for d in found] == ["job_slow"] and found[0].node is None
    assert "the cause is the job" in found[0].describe()
    assert action_for(found[0], "replace", 5, 0, 2)[0] == "alert"


def test_a_slowdown_most_peers_share_names_nobody():
    """Three of four nodes slow: each slow node's peers (the other three) are mostly slow too."""
    r = rule(nodes=4)
    assert [d for d in feed(r, range(1, 60), lambda k, s: 0.2 if k < 6 else 0.1) if d.kind == "straggler"] == []


def test_ranks_of_different_stages_are_not_compared():
    """pp=2 over 2 nodes, one stage per node: the last stage's extra work (the loss) is no straggler."""
    r = rule(nodes=2, layout={"dp": 2, "tp": 1, "pp": 2})
    assert feed(r, range(1, 60), lambda k, s: 0.3 if k >= 2 else 0.1) == []
    # the same work split over nodes (stage = dp x tp ranks spanning both): compared
    r = rule(nodes=2, per_node=2, layout={"dp": 2, "tp": 2, "pp": 1})
    assert [d.node for d in feed(r, range(1, 60), lambda k, s: 0.3 if k >= 2 else 0.1)] == ["node1"]


def test_a_stage_spans_its_cp_ranks():
    """cp2 x pp2 on four one-rank nodes: a stage is its cp ranks (the grid is pp, dp, cp, tp), so
    the last stage's extra work names nobody and its slowed cp rank is named against the other.
    With a stage taken as dp x tp ranks, each rank was a stage alone and nobody was ever named."""
    r = rule(nodes=4, per_node=1, layout={"dp": 1, "tp": 1, "pp": 2, "cp": 2})
    work = {0: 0.1, 1: 0.1, 2: 0.2, 3: 0.4}
    assert [d.node for d in feed(r, range(1, 60), lambda k, s: work[k] if s > 2 else 0.1)] == ["node3"]


def test_noise_larger_than_the_gap_is_no_straggler():
    """A rank whose steps alternate 0.02 and 0.26 s has a median 1.4x its peers' (0.1 s) but a
    spread (MAD 0.12 s) far wider than that gap: not named. Steady at 0.14 s, it would be."""
    r = rule(nodes=4)
    assert feed(r, range(1, 200), lambda k, s: (0.02, 0.26)[s % 2] if k == 0 else 0.1) == []
    r = rule(nodes=4)
    assert [d.node for d in feed(r, range(1, 200), lambda k, s: 0.14 if k == 0 else 0.1)] == ["node0"]


def test_state_is_one_open_window_and_a_few_summaries_per_rank():
    r = rule()
    feed(r, range(1, 500), lambda k, s: 0.1)
    assert all(len(s.values) < W and len(s.closed) <= KEEP for s in r.ranks.values())


def test_a_peers_median_without_a_node_is_the_median_of_what_is_left():
    """Ties included (equal medians are common: the same work on the same hardware)."""
    rng = random.Random(0)
    for _ in range(5000):
        values = [rng.choice([0.1, 0.2, rng.random()]) for _ in range(rng.randint(2, 24))]
        gone = set(rng.sample(range(len(values)), rng.randint(1, len(values) - 1)))
        left = [v for i, v in enumerate(values) if i not in gone]
        assert median_without(sorted(values), [values[i] for i in gone]) == statistics.median(left)


def test_judging_a_window_of_12288_ranks_in_one_stage_takes_well_under_a_second():
    """A pure-dp job: one stage of 1,536 nodes. Each node's peers' median recomputed from its
    12,280 peers took 6.6 s of CPU a window in the driver's control loop (most of its core at
    1,536 nodes); one sort per stage takes 0.04 s. And one slowed node is still named."""
    ranks = 12288
    r = StragglerRule(1.3, 1, W, 0)
    r.reset({k: f"node{k // 8}" for k in range(ranks)}, {"dp": ranks})
    rng = random.Random(1)
    for k in range(ranks):
        r.observe(k, [(s, (0.3 if k < 8 else 0.1) + rng.random() * 0.01) for s in range(W)])
    start = time.process_time()
    found = r.check()
    assert time.process_time() - start < 1.0
    assert [(d.node, d.ranks) for d in found] == [("node0", list(range(8)))]


def test_replacement_is_bounded():
    r = rule()
    d = feed(r, range(1, 60), lambda k, s: 0.2 if k in (2, 3) else 0.1)[0]
    assert action_for(d, "replace", 2, 0, 2) == ("replace", "replaced by a spare in place (peer-memory restore)")
    assert "last spare" in action_for(d, "replace", 1, 0, 2)[1]
    assert "max_evictions_per_hour = 2" in action_for(d, "replace", 3, 2, 2)[1]
    assert action_for(d, "alert", 3, 0, 2) == ("alert", "resilience.straggler_action = 'alert'")


# ---------------------------------------------------------------------- the driver acting on it
def _small_windows(driver) -> None:
    """3-step windows: the in-process job has 16 steps (the driver refuses steps beyond them)."""
    driver.rcfg.straggler_window_steps = 3
    driver.straggler = straggler_rule(driver.rcfg)
    driver.straggler.reset({0: "node0", 1: "node0", 2: "node1", 3: "node1"}, driver.state.layout)


def _slow_node1(driver, now: float, beats: int = 5, start: int = 1) -> float:
    """Heartbeats in which node1's ranks compute 2x node0's, 3 steps a beat."""
    _small_windows(driver)
    history: dict[int, list] = {k: [] for k in range(4)}
    for beat in range(beats):
        at = time.time()  # the driver's liveness clock is the wall clock
        for step in range(start + 3 * beat, start + 3 * beat + 3):
            for k in range(4):
                history[k] = [*history[k][-15:], [step, 0.2 if k >= 2 else 0.1]]
        last = start + 3 * beat + 2
        for node, ks in (("node0", (0, 1)), ("node1", (2, 3))):
            driver.on_heartbeat(heartbeat(node, at, [rank(k, step=last, compute=history[k]) for k in ks]))
        driver.on_heartbeat(heartbeat("node2", at, []))
        if "node3" in driver.state.nodes:
            driver.on_heartbeat(heartbeat("node3", at, []))
        driver.tick(at + 0.1)
        if driver.state.phase != "running":
            return at
    return at


def test_the_driver_replaces_a_straggler_with_a_spare_in_place(tmp_path):
    driver, now = fast_driver(tmp_path)
    driver.on_register(via_api(protocol.Register, {"node_id": "node3", "address": "10.0.0.4", "host": "node3"}))
    at = _slow_node1(driver, now)
    assert driver.state.phase == "recovering"
    fault = driver.store.events("fault")[-1]
    assert fault["kind"] == "straggler" and fault["node"] == "node1" and fault["selfcheck"]["run"] is False
    pauses = commands(driver, "pause")
    assert (pauses["node0"]["kill"], pauses["node1"]["kill"]) == ([], [2, 3])
    answer(
        driver,
        at + 1,
        {"node0": {"ok": True, "paused": [0, 1], "dead": []}, "node1": {"ok": True, "paused": [], "dead": [2, 3]}},
    )
    driver.tick(at + 1.1)
    nodes = driver.state.nodes
    assert driver.state.phase == "running" and nodes["node1"].role == "evicted"
    assert nodes["node2"].role == "active" and nodes["node2"].slot == 1
    assert commands(driver, "start")["node0"]["keep"] == [0, 1]
    detection = driver.store.events("straggler")[-1]
    assert detection["action"] == "replace" and detection["ratio"] == pytest.approx(2.0)
    assert detection["cost"] == pytest.approx(0.5)
    row = detection_rows(_summary_file(tmp_path, driver))[0]  # what `megascale report` shows
    assert (row["where"], row["ratio"], row["cost"], row["action"]) == ("node1", "2.00x", "50%", "replace")


def test_the_driver_only_alerts_when_the_spare_is_the_last_one(tmp_path):
    driver, now = fast_driver(tmp_path)  # one spare
    _slow_node1(driver, now)
    assert driver.state.phase == "running" and driver.state.nodes["node1"].role == "active"
    alert = driver.store.events("alert")[-1]
    assert alert["kind"] == "straggler" and "last spare" in alert["detail"]
    assert driver.store.events("straggler")[-1]["action"] == "alert"


def test_straggler_config_is_checked_and_off_turns_the_rule_off(tmp_path):
    with pytest.raises(Exception, match="resilience.straggler_threshold"):
        load_config(None, ["--resilience.straggler_threshold=0.9"])
    with pytest.raises(Exception, match="resilience.straggler_windows"):
        load_config(None, ["--resilience.straggler_windows=0"])
    cfg = load_config(None, [])
    assert straggler_rule(cfg.resilience).threshold == cfg.resilience.straggler_threshold
    driver, now = fast_driver(tmp_path)
    driver.rcfg.straggler_action = "off"
    _slow_node1(driver, now)
    assert driver.store.events("straggler") == []
