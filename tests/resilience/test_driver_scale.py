"""The driver's cost per operation does not grow with the run's length or the job's size.

In-process (the handlers and the control loop as the API and `run()` call them, bodies checked
by the API's schemas first); costs are this thread's CPU time, compared within one test, so a
loaded machine shifts both sides alike. The live counterparts (real TLS, a driver process and
hundreds of simulated executors) are in test_driver_live_scale.py and bench/scale.py.
"""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from megascale.config import load_config
from megascale.config.handoff import config_text
from megascale.resilience.common import protocol
from megascale.resilience.driver.driver import Driver
from megascale.resilience.driver.state import JobState, JobStore
from tests.resilience.test_attribution import via_api

pytestmark = [pytest.mark.serial, pytest.mark.timeout(300)]  # CPU-cost ratios: run alone (scripts/test.sh)


def driver_for(tmp_path, nodes: int, ranks_per_node: int, *flags: str) -> Driver:
    world = nodes * ranks_per_node
    cfg = load_config(
        None,
        [
            f"--parallel.dp={world}",
            f"--train.global_batch={world}",
            "--train.micro_batch=1",
            "--train.steps=1000000000",
            "--resilience.hang_floor_s=600",
            *flags,
        ],
    )
    state = JobState(
        "j",
        nodes,
        ranks_per_node,
        {"dp": world, "tp": 1, "pp": 1},
        train_config=config_text(cfg),
        run_dir=str(tmp_path),
    )
    return Driver(cfg, state, JobStore(tmp_path / "driver.sqlite"))


def register(driver: Driver, index: int) -> None:
    status, _ = driver.on_register(
        via_api(
            protocol.Register,
            {"node_id": f"n{index}", "address": f"10.0.{index >> 8}.{index & 255}", "host": f"h{index}"},
        )
    )
    assert status == 200


def beat(node: str, ranks: list[int], step: int, recent: list[tuple[int, float]]) -> dict:
    """A heartbeat as the API hands it to the handler (schema-checked and completed)."""
    return via_api(
        protocol.Heartbeat,
        {
            "node_id": node,
            "time": time.time(),
            "attempt": 0,
            "net_shared": True,
            "ranks": [
                {
                    "rank": r,
                    "local_rank": i,
                    "pid": 100 + r,
                    "alive": True,
                    "step": step,
                    "step_time": 0.1,
                    "recent": recent,
                }
                for i, r in enumerate(ranks)
            ],
        },
    )


def cpu(fn) -> float:
    started = time.thread_time()
    fn()
    return time.thread_time() - started


def test_100000_steps_of_heartbeats_cost_the_same_per_heartbeat(tmp_path):
    """12,500 heartbeats of 8 ranks, each with the 8 steps since the last one (100,000 steps),
    the control loop ticking every 4th: the last 1,000 heartbeats cost what the first 1,000 did
    (today's slow-step rule, sorting every step time it ever saw, grows without end), and the
    slowdown rule still fires after 100,000 steps."""
    driver = driver_for(tmp_path, 1, 8)
    register(driver, 0)
    driver.tick(time.time())
    ranks = list(range(8))
    costs, deadline = [], time.monotonic() + 120
    for i in range(12_500):
        steps = range(8 * i + 1, 8 * i + 9)
        body = beat("n0", ranks, steps[-1], [(s, 0.1 + 0.001 * (s % 7)) for s in steps])
        started = time.thread_time()
        driver.on_heartbeat(body)
        if i % 4 == 3:
            driver.tick(time.time())
        costs.append(time.thread_time() - started)
        assert time.monotonic() < deadline, f"heartbeat {i}: {sum(costs[-100:]) / 100 * 1e3:.2f} ms each and growing"
    assert driver.state.phase == "running" and driver.hang.last_step == 100_000
    first, last = sum(costs[100:1100]), sum(costs[-1000:])
    assert last < 1.5 * first + 0.05, (first, last)
    for i in range(12_500, 12_502):  # the job slows down 5x: the rule still sees it
        steps = range(8 * i + 1, 8 * i + 9)
        driver.on_heartbeat(beat("n0", ranks, steps[-1], [(s, 0.5) for s in steps]))
    slow = driver.slow.check()
    assert slow is not None and slow.kind == "slow", slow


def test_a_heartbeat_repeating_the_last_16_step_times_costs_about_one_with_only_the_new_one(tmp_path):
    """Executors send each rank's last 16 step times in every heartbeat; the rules need each
    once. Fed all of them, the slow rule made 128 updates a heartbeat at 8 ranks (4.1x the cost of
    a heartbeat carrying only the new step; now 1.2x)."""
    per_beat = {}
    for window in (16, 1):
        driver = driver_for(tmp_path / str(window), 1, 8)
        register(driver, 0)
        driver.tick(time.time())
        ranks, total = list(range(8)), 0.0
        for step in range(1, 2001):
            body = beat("n0", ranks, step, [(s, 0.1) for s in range(max(1, step - window + 1), step + 1)])
            total += cpu(lambda b=body, d=driver: d.on_heartbeat(b))
        assert driver.hang.last_step == 2000 and driver.slow.baseline is not None
        per_beat[window] = total / 2000
    assert per_beat[16] < 2.0 * per_beat[1], per_beat


def test_one_heartbeat_with_16384_step_times_does_not_stall_the_control_loop(tmp_path):
    """256 ranks x 64 recent step times (the schema's caps): one heartbeat and a tick in well
    under a second of CPU (today's rule took minutes: min() of all steps per step)."""
    driver = driver_for(tmp_path, 1, 256)
    register(driver, 0)
    driver.tick(time.time())
    ranks = list(range(256))
    body = via_api(
        protocol.Heartbeat,
        {
            "node_id": "n0",
            "time": time.time(),
            "attempt": 0,
            "net_shared": True,
            "ranks": [
                {
                    "rank": r,
                    "local_rank": r,
                    "pid": 100 + r,
                    "alive": True,
                    "step": 16_384,
                    "recent": [[64 * r + k, 0.1] for k in range(64)],
                }
                for r in ranks
            ],
        },
    )
    spent = cpu(lambda: (driver.on_heartbeat(body), driver.tick(time.time())))
    assert spent < 0.5, f"{spent:.2f} s of CPU for one heartbeat and one tick"
    assert driver.state.phase == "running"


def test_registration_costs_the_same_for_the_400th_node_as_for_the_first(tmp_path):
    """400 nodes register: the last 50 cost what the first 50 did (today: the whole job state
    rewritten and every node sorted twice per registration, O(N) each)."""
    driver = driver_for(tmp_path, 400, 8)
    costs = [cpu(lambda i=i: register(driver, i)) for i in range(400)]
    first, last = sum(costs[10:60]), sum(costs[-50:])
    assert last < 1.6 * first + 0.01, (first, last)
    driver.tick(time.time())
    assert driver.state.phase == "running" and len(driver.attempt_watch.nodes) == 400
    again = JobStore(tmp_path / "driver.sqlite").load()  # every registration was committed
    assert len(again.nodes) == 400 and sorted(n.slot for n in again.nodes.values()) == list(range(400))


def test_a_stalled_disk_delays_registrations_but_never_heartbeats(tmp_path):
    """Another writer holds the state database (a slow disk, a backup): a registration waits
    for its commit, outside the driver's lock, so heartbeats are answered meanwhile."""
    driver = driver_for(tmp_path, 2, 1, "--resilience.spares=1")
    register(driver, 0)
    register(driver, 1)
    driver.tick(time.time())
    blocker = sqlite3.connect(tmp_path / "driver.sqlite", timeout=30)
    blocker.execute("BEGIN EXCLUSIVE")
    registering = threading.Thread(target=register, args=(driver, 2), daemon=True)
    registering.start()
    time.sleep(0.3)  # the registration is now waiting for the database
    started = time.monotonic()
    status, _ = driver.on_heartbeat(beat("n0", [0], 1, [(1, 0.1)]))
    answered = time.monotonic() - started
    time.sleep(0.7)
    blocker.rollback()
    blocker.close()
    registering.join(10)
    assert status == 200 and answered < 0.5, answered
    assert not registering.is_alive() and driver.state.nodes["n2"].role == "spare"


def test_a_tick_costs_the_same_at_400_nodes_as_at_25(tmp_path):
    """Once every node's report is judged, a tick does not walk every rank of the job again
    (today: every report of every node, 3,200 ranks at 400 x 8, four times a second)."""
    per_tick = {}
    for nodes in (25, 400):
        driver = driver_for(tmp_path / str(nodes), nodes, 8)
        for i in range(nodes):
            register(driver, i)
        driver.tick(time.time())
        for i in range(nodes):
            driver.on_heartbeat(beat(f"n{i}", list(range(8 * i, 8 * i + 8)), 5, [(5, 0.1)]))
        driver.tick(time.time())  # judges the reports that came
        per_tick[nodes] = cpu(lambda d=driver: [d.tick(time.time()) for _ in range(200)]) / 200
        assert driver.state.phase == "running"
    assert per_tick[400] < 2.0 * per_tick[25] + 20e-6, per_tick


@pytest.mark.slow  # the one evidence child imports torch: 10-40 s on 2 loaded cores
def test_slowdown_alerts_in_a_burst_start_one_evidence_child_and_stopping_never_waits_for_it(tmp_path):
    """Five slowdown alerts at once: one straggler analysis (a child process that imports torch)
    is queued, the other four are recorded without it (today: five children at once, ~200 MB
    each). `stop` meanwhile answers at once (today it joined the evidence under the lock), and
    the summary written after the loop still carries the analysed alert."""
    from megascale.resilience.driver.rules import Finding

    driver = driver_for(tmp_path, 1, 1)
    register(driver, 0)
    driver.tick(time.time())
    for i in range(5):
        with driver.lock:
            driver._alert(Finding("slow", "alert", f"steps {i}: 3.0x the baseline"), time.time())
    started = time.monotonic()
    assert driver.on_stop({"reason": "test"})[0] == 200
    assert driver.on_heartbeat(beat("n0", [0], 1, []))[0] in (200, 403)
    assert time.monotonic() - started < 5.0  # today: up to 30 s per evidence thread, joined under the lock
    assert driver.background.drain(180)  # the child's torch import, on a loaded machine
    summary = driver.write_summary()
    alerts = [a for a in summary["alerts"] if a["kind"] == "slow"]
    assert len(alerts) == 5 and sum("evidence" in a for a in alerts) == 4, alerts
    assert sum(a.get("stragglers") is not None for a in alerts) == 1  # its child ran (no timers here: [])


def test_a_status_at_1536_nodes_carries_no_per_step_series(tmp_path):
    """The ranks' recent step and compute times are the rules' input, not the operator's: with
    them a status at 1,536 nodes of 8 ranks was 5.8 MB and took 5.5 s (bench/scale.py)."""
    driver = driver_for(tmp_path, 1, 8)
    register(driver, 0)
    body = beat("n0", list(range(8)), 16, [(s, 0.1) for s in range(1, 17)])
    for r in body["ranks"]:
        r["compute"] = [[s, 0.08] for s in range(1, 17)]
    driver.on_heartbeat(body)
    ranks = driver.on_status({})[1]["nodes"]["n0"]["ranks"]
    assert len(ranks) == 8 and all(r["step"] == 16 for r in ranks)
    assert not [k for r in ranks for k in r if k in ("recent", "compute")], ranks[0]
