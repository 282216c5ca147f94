"""Correlated silence in the driver's control loop, in-process on the test's clock (the live
job is tests/resilience/test_partition.py): most nodes silent at once is nobody's fault, a stop
that reached no node is not done, and the start-up timeout counts from the last registration."""

from __future__ import annotations

import time

from megascale.resilience.common import protocol
from tests.resilience.test_attribution import via_api
from tests.resilience.test_recovery import heartbeat, rank, started_driver


def test_every_node_silent_is_no_fault_but_one_left_silent_after_is(tmp_path):
    driver, now = started_driver(tmp_path, "--resilience.in_place=false")  # 2 nodes, timeout 5 s
    driver.last_seen.update(node0=now, node1=now)
    for t in (now + 6, now + 9, now + 12):  # both silent for up to 12 s: the driver's stall, or the network's
        driver.tick(t)
        assert driver.state.phase == "running" and driver.store.events("fault") == []
    driver.on_heartbeat(heartbeat("node0", now + 12.5, [rank(0), rank(1)]))
    driver.last_seen["node0"] = now + 12.5  # back, on the test's clock; node1 is not
    driver.tick(now + 13)
    assert driver.state.phase == "running"  # node1 is judged from the end of the silence
    driver.last_seen["node0"] = now + 17.5
    driver.tick(now + 18.1)
    assert driver.state.phase == "stopping"
    assert [(f["kind"], f["node"]) for f in driver.store.events("fault")] == [("heartbeat_lost", "node1")]


def test_a_stop_that_reached_no_node_waits_and_is_sent_again(tmp_path):
    """An operator's eviction while every node is silent: the stop goes to nobody. Today that
    counted as every node stopped, and every node was then evicted as lost (the job failed:
    no node left); now the driver waits for the deadline and sends it again to the nodes back."""
    driver, now = started_driver(tmp_path, "--resilience.in_place=false", "--resilience.stop_timeout_s=2")
    driver.on_evict(via_api(protocol.Evict, {"node_id": "node1", "reason": "operator"}))
    driver.last_seen.update(node0=now - 10, node1=now - 10)
    driver.tick(now)
    assert driver.state.phase == "stopping" and driver.waiting_for == {}
    driver.tick(now + 1)
    assert driver.state.phase == "stopping" and driver.state.evicted == []
    driver.last_seen.update(node0=now + 2.5, node1=now + 2.5)  # heard from again
    driver.tick(now + 2.6)  # the deadline passed: the stop goes out again, to both
    assert set(driver.waiting_for) == {"node0", "node1"}
    for node, command in driver.waiting_for.items():
        driver.on_heartbeat(heartbeat(node, now + 3, [], done={command: {"ok": True, "stopped": 2}}))
    driver.last_seen.update(node0=now + 3, node1=now + 3)
    driver.tick(now + 3.1)  # an operator's eviction needs no self-check: node1 goes, node0 trains on
    assert driver.state.phase == "running" and driver.state.attempt == 1 and driver.state.evicted == ["node1"]


def test_the_start_up_timeout_counts_from_the_last_registration(tmp_path):
    """300 nodes registering over 1.5 s with a 1 s start-up timeout: steady progress is no
    failure (today the timeout ran from the driver's creation); a second without any is."""
    from tests.resilience.test_driver_scale import driver_for, register

    driver = driver_for(tmp_path, 300, 8, "--resilience.startup_timeout_s=1")
    for i in range(299):
        register(driver, i)
        driver.tick(time.time())
        time.sleep(0.005)
    assert driver.state.phase == "starting", driver.state.reason
    driver.tick(time.time() + 1.5)
    assert driver.state.phase == "failed" and "resilience.startup_timeout_s" in driver.state.reason
    assert "only 299 of 300 nodes registered" in driver.state.reason
