"""Shrinking after a lost node with no spare: the layout chosen, the split of the batch, the cost.

At 1,536 nodes of 8 ranks in tp8 pp8 dp192 (a replica is 64 ranks, 8 nodes) with a global
batch of 1,536 sequences, losing one node leaves 1,535. `resilience.shrink = "keep-batch"`
runs dp 191 on 1,528 nodes (the 7 left over cannot hold a replica), 8 replicas taking 9
micro-batches and 183 taking 8; "divide" (the old rule: dp must divide the batch) drops to dp
128 on 1,024 nodes, 511 healthy nodes idle. The real driver, in-process, makes the choice.
"""

from __future__ import annotations

import time

import pytest

from megascale.config import ConfigError, load_config
from megascale.config.handoff import config_text
from megascale.resilience.driver.driver import Driver
from megascale.resilience.driver.placement import PlacementError, layout_for, shrink_cost, usable_nodes
from megascale.resilience.driver.state import ACTIVE, SPARE, JobState, JobStore
from tests.resilience.test_driver_scale import register

NODES, RANKS = 1536, 8
BIG = [
    "--parallel.tp=8",
    "--parallel.pp=8",
    f"--parallel.dp={NODES * RANKS // 64}",
    "--model.layers=16",
    "--model.heads=16",
    "--model.hidden=256",
    "--train.global_batch=1536",
    "--train.micro_batch=1",
    "--train.steps=1000000",
]


def big(*flags: str):
    return load_config(None, [*BIG, *flags])


def test_losing_1_of_1536_nodes_keeps_1528_busy_and_the_same_batch(tmp_path):
    cfg = big("--resilience.hang_floor_s=600")
    state = JobState(
        "j", NODES, RANKS, layout_for(cfg, NODES, RANKS), train_config=config_text(cfg), run_dir=str(tmp_path)
    )
    driver = Driver(cfg, state, JobStore(tmp_path / "driver.sqlite"))
    for i in range(NODES):
        register(driver, i)
    driver.tick(time.time())
    assert driver.state.layout == {"dp": 192, "tp": 8, "pp": 8, "cp": 1}
    with driver.lock:  # node 700 is lost: evicted, and every rank restarts on the nodes left
        driver._evict(driver.state.nodes["n700"], "lost: no heartbeat", save=False)
        driver._restart(time.time(), reason="test: a lost node, no spare")
    s = driver.state
    assert s.layout == {"dp": 191, "tp": 8, "pp": 8, "cp": 1} and s.attempt == 1
    active, idle = s.role(ACTIVE), s.role(SPARE)
    assert len(active) == 1528 and len(idle) == 7  # 1535 * 8 ranks hold 191 replicas of 64, not 192
    assert sorted(n.slot for n in active) == list(range(1528))
    shares = load_config(None, [*BIG, "--parallel.dp=191"]).shares
    counts = [shares.micro_batches(r) for r in range(191)]
    assert counts.count(9) == 8 and counts.count(8) == 183 and sum(counts) == 1536
    starts = [shares.first_sequence(r) for r in range(191)] + [1536]
    assert all(starts[r + 1] - starts[r] == counts[r] for r in range(191))  # contiguous, all of the batch
    (event,) = driver.store.events("shrink")
    cost = event["cost"]
    assert "1528 of 1535 node(s) train, 7 idle (56 ranks left over; a replica is tp*pp*cp = 64)" in cost, cost
    assert "dp 192 -> 191" in cost, cost
    assert "0.938x" in cost and "divide would use 1024 nodes (dp 128, 0.789x)" in cost, cost


def test_divide_drops_to_the_largest_dp_dividing_the_batch():
    cfg = big("--resilience.shrink=divide")
    assert usable_nodes(cfg, NODES - 1, NODES, RANKS) == 1024
    assert layout_for(cfg, 1024, RANKS)["dp"] == 128
    cost = shrink_cost(cfg, NODES, NODES - 1, 1024, RANKS)
    assert "511 idle (dp 129 to 191 would not split the batch" in cost and "0.789x" in cost, cost
    assert "keep-batch would use 1528 nodes (dp 191, 0.938x)" in cost, cost


def test_layouts_that_cannot_keep_the_batch_are_refused_by_name():
    # 128 sequences of 1: at most 128 replicas hold one each; 1,536 nodes' dp 192 cannot
    with pytest.raises(PlacementError, match=r"dp=192 .*128 micro-batch.*fewer than parallel.dp=192"):
        layout_for(big("--train.global_batch=128", "--parallel.dp=128"), NODES, RANKS)
    assert usable_nodes(big("--train.global_batch=128", "--parallel.dp=128"), NODES - 1, NODES, RANKS) == 1024
    with pytest.raises(ConfigError, match=r"global_batch=1537 must be a multiple of train.micro_batch=2"):
        big("--train.global_batch=1537", "--train.micro_batch=2", "--parallel.dp=1")
    # interleaved 1F1B: each replica's count must divide by pp; 9 and 8 over pp 8 cannot
    vpp = big("--parallel.vpp=2", "--train.global_batch=3072")
    assert layout_for(vpp, NODES, RANKS)["dp"] == 192
    with pytest.raises(PlacementError, match=r"interleaved 1F1B .*17 micro-batch\(es\) of 1 on 16"):
        layout_for(vpp, 1528, RANKS)
    assert usable_nodes(vpp, NODES - 1, NODES, RANKS) == 1024  # dp 128: 24 each


def test_the_fail_slow_rule_judges_uneven_replicas_by_their_work():
    """dp 4 with 6 micro-batches: replicas 0-1 run 2, replicas 2-3 run 1, so 0-1 compute twice
    as long. Judged by its raw times node0 would be named slow; scaled by its share, nobody is,
    and a replica running one micro-batch that is really 2x slow still is."""
    from megascale.resilience.driver.placement import compute_scale
    from megascale.resilience.driver.straggler_rule import StragglerRule

    cfg = load_config(None, ["--parallel.dp=4", "--train.global_batch=6", "--train.micro_batch=1"])
    layout = layout_for(cfg, 4, 1)
    scale = compute_scale(cfg, layout)
    assert scale == {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}
    assert (
        compute_scale(load_config(None, ["--parallel.dp=4", "--train.global_batch=8", "--train.micro_batch=1"]), layout)
        == {}
    )

    def run(scale: dict[int, float], slow: int | None) -> list[str]:
        rule = StragglerRule(1.3, 2, 4, 2)
        rule.reset({r: f"node{r}" for r in range(4)}, layout, scale)
        named = []
        for step in range(1, 40):
            for r in range(4):
                work = 0.1 * (2 if r < 2 else 1) * (2 if r == slow and step > 10 else 1)
                rule.observe(r, [(step, work)])
            named += [d.node for d in rule.check() if d.kind == "straggler"]
        return named

    assert run({}, None)[:1] == ["node0"]  # unscaled: the busier replicas look slow
    assert run(scale, None) == []
    assert run(scale, 2)[:1] == ["node2"]


def test_expert_parallel_groups_must_run_one_count():
    """ep groups are consecutive dp ranks that all-to-all every micro-batch: uneven shares are
    accepted only when ep divides the micro-batch count, so the replicas with one more fill whole
    groups. (A job that starts with even shares has that already: dp divides it and ep divides dp.)"""
    moe = ["--model.moe.experts=4", "--train.micro_batch=1"]
    cfg = load_config(None, [*moe, "--parallel.ep=2", "--parallel.dp=4", "--train.global_batch=8"])
    assert layout_for(cfg, 3, 2)["dp"] == 6  # 8 over 6: 2, 2 | 1, 1 | 1, 1 by ep pair
    with pytest.raises(ConfigError, match=r"parallel.ep=4 with 2 micro-batch\(es\) of 1 on 2 replica.*= 6 must be"):
        load_config(None, [*moe, "--parallel.ep=4", "--parallel.dp=4", "--train.global_batch=6"])
