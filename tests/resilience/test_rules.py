"""Each detection rule on synthetic timelines (explicit `now`, no sleeping)."""

from megascale.config.operations import ResilienceConfig
from megascale.resilience.driver.rules import (
    HangRule,
    SlowRule,
    TrafficRule,
    abnormal_exits,
    error_lines,
    hang_rule,
    interface_bytes,
)
from megascale.resilience.driver.silence import SilenceWatch


def test_abnormal_exit_by_signal_or_code_but_not_success_or_running():
    ranks = [
        {"rank": 0, "exitcode": None},
        {"rank": 1, "exitcode": -9},
        {"rank": 2, "exitcode": 0},
        {"rank": 3, "exitcode": 1},
    ]
    found = abnormal_exits("node0", ranks)
    assert [(f.rank, f.severity) for f in found] == [(1, "fault"), (3, "fault")]
    assert "signal 9" in found[0].detail and "exit code 1" in found[1].detail


def test_error_keyword_matches_configured_keywords_only():
    lines = [
        {"rank": 2, "text": "Traceback (most recent call last):"},
        {"rank": 2, "text": "step 5 loss 3.2"},
        {"rank": 3, "text": "NCCL error: unhandled"},
    ]
    found = error_lines("node1", lines, ["Traceback (most recent call last)", "NCCL error"])
    assert [(f.kind, f.rank, f.node) for f in found] == [("error_keyword", 2, "node1"), ("error_keyword", 3, "node1")]
    assert error_lines("node1", lines, ["CUDA error"]) == []


def test_one_silent_node_is_lost_but_most_nodes_silent_together_is_nobodys_fault():
    watch = SilenceWatch(timeout_s=3.0, fraction=0.5)
    for node, t in (("a", 100.0), ("b", 104.5), ("c", 104.6)):
        watch.last_seen[node] = t
    assert watch.lost(105.0) == ([("a", 100.0)], 0.0) and not watch.correlated
    assert watch.lost(108.0) == ([], 0.0) and watch.correlated  # all three: the driver's stall, or the network's
    watch.last_seen["b"], watch.last_seen["c"] = 110.0, 110.0  # heartbeats are back, but not a's
    assert watch.lost(110.5) == ([], 10.5) and not watch.correlated  # 10.5 s without evidence
    watch.last_seen["b"], watch.last_seen["c"] = 112.0, 112.0
    assert watch.lost(113.0)[0] == []  # a is judged from the episode's end
    watch.last_seen["b"], watch.last_seen["c"] = 113.4, 113.4
    assert watch.lost(113.6)[0] == [("a", 100.0)]
    watch = SilenceWatch(timeout_s=4.0, fraction=0.5)  # last beats a period apart, then all stop
    for node, t in (("a", 200.0), ("b", 200.6), ("c", 200.9)):
        watch.last_seen[node] = t
    assert watch.lost(204.1) == ([], 0.0) and watch.correlated  # a crossed first: not judged alone


def test_hang_no_false_alarm_on_a_slow_first_step():
    rule = HangRule(startup_s=60, floor_s=5, factor=5, warmup=2)
    rule.reset(0.0)
    assert rule.check(40.0, all_alive=True) is None  # still starting: 40 s < 60 s
    rule.observe(1, [(1, 40.0)], 40.0)  # a 40 s first step
    assert rule.check(55.0, all_alive=True) is None  # warm-up: the start-up window still applies
    rule.observe(2, [(2, 0.5)], 40.5)
    rule.observe(3, [(3, 0.4)], 41.0)
    assert rule.window_s == 5.0  # floor; the slow first step is not part of the learned maximum
    assert rule.check(45.0, all_alive=True) is None
    found = rule.check(46.5, all_alive=True)
    assert found is not None and found.kind == "hang" and "after step 3" in found.detail


def test_hang_window_learned_from_observed_step_times():
    rule = HangRule(startup_s=60, floor_s=2, factor=5, warmup=1)
    rule.reset(0.0)
    for step in range(1, 6):
        rule.observe(step, [(step, 1.5)], float(step))
    assert rule.window_s == 7.5
    assert rule.check(5.0 + 7.0, all_alive=True) is None
    assert rule.check(5.0 + 8.0, all_alive=True) is not None


def test_hang_not_reported_while_a_rank_is_down():
    rule = hang_rule(ResilienceConfig(startup_timeout_s=1.0), total_steps=10)
    rule.reset(0.0)
    assert rule.check(10.0, all_alive=False) is None
    assert rule.check(10.0, all_alive=True) is not None


def test_resumed_attempt_warms_up_from_its_own_first_step():
    rule = HangRule(startup_s=60, floor_s=1, factor=5, warmup=2)
    rule.reset(0.0)
    rule.observe(5, [(5, 9.0)], 10.0)  # resumed at step 5: a slow re-warm-up
    rule.observe(6, [(6, 9.0)], 19.0)
    rule.observe(7, [(7, 0.2)], 19.2)
    assert rule.window_s == 1.0


def test_slowdown_is_an_alert_once_per_episode():
    rule = SlowRule(factor=2.0, warmup=1)
    for step in range(1, 7):
        rule.observe(step, 1.0 if step == 1 else 0.1)
    assert rule.check() is None
    for step in range(7, 12):
        rule.observe(step, 0.5)
    found = rule.check()
    assert found is not None and found.severity == "alert" and found.kind == "slow"
    rule.observe(12, 0.5)
    assert rule.check() is None  # same episode


def test_slowdown_ignores_jitter_and_resumed_warmup():
    rule = SlowRule(factor=2.0, warmup=1)
    for step, t in zip(range(5, 16), [3.0, 0.1, 0.12, 0.09, 0.1, 0.15, 0.11, 0.1, 0.13, 0.1, 0.12], strict=True):
        rule.observe(step, t)
    assert rule.baseline is not None and rule.baseline < 0.2
    assert rule.check() is None


def test_traffic_to_zero_is_a_fault_and_a_sharp_fall_an_alert():
    rule = TrafficRule("node1", window_s=3.0, fall_ratio=0.2)
    total, t = 0, 0.0
    for _ in range(4):  # 1 MB/s
        total += 1_000_000
        t += 1.0
        assert rule.observe(total, t, running=True) is None
    total += 100_000  # 0.1 MB/s: a fall below 20 %
    t += 1.0
    alert = rule.observe(total, t, running=True)
    assert alert is not None and alert.severity == "alert" and alert.kind == "traffic_fall"
    findings = []
    for _ in range(5):
        t += 1.0
        findings.append(rule.observe(total, t, running=True))
    fault = next(f for f in findings if f is not None)
    assert fault.kind == "traffic_zero" and fault.severity == "fault" and fault.node == "node1"


def test_traffic_rule_quiet_while_ranks_are_not_running():
    rule = TrafficRule("n", window_s=1.0, fall_ratio=0.2)
    for t in range(10):
        assert rule.observe(5, float(t), running=False) is None


def test_interface_bytes_leaves_loopback_out_unless_named():
    counters = {"lo": [100, 100], "eth0": [5, 7]}
    assert interface_bytes(counters, []) == 12
    assert interface_bytes(counters, ["lo"]) == 200
    assert interface_bytes({"lo": [1, 1]}, []) is None


def test_hang_warmup_counts_steps_done_between_heartbeats():
    rule = HangRule(startup_s=120, floor_s=5, factor=5, warmup=2)
    rule.reset(0.0)
    rule.observe(6, [(s, 0.07) for s in range(1, 7)], 1.0)  # six fast steps in one heartbeat
    assert rule.window_s == 5.0
    assert rule.check(6.5, all_alive=True) is not None


def test_no_hang_while_saving_and_tearing_down_after_the_last_step():
    rule = HangRule(startup_s=60, floor_s=5, factor=5, warmup=1, total_steps=8)
    rule.reset(0.0)
    rule.observe(8, [(s, 0.1) for s in range(1, 9)], 1.0)
    assert rule.check(30.0, all_alive=True) is None
    assert rule.check(62.0, all_alive=True) is not None
