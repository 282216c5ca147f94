"""Each second-order effect of the cost model against a hand-computed case, and its switch."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from megascale.plan import comm, congestion, ecmp, placement
from megascale.plan.cost import estimate
from megascale.plan.layout import Effects, Features, Implementation, Layout
from megascale.plan.search import SearchSpace, search
from megascale.plan.stragglers import (
    Jitter,
    SlowHosts,
    expected_max_empirical,
    expected_max_std_normal,
)

IDEAL = Features(effects=Effects.without(list(Effects.NAMES)))


def busy(est) -> float:
    t = est.terms
    return t["compute"] + t["tp_exposed"] + t["launch_gaps"] + t["interleave"] + t["contention"]


def test_normal_order_statistics_match_the_closed_forms():
    # E[max of 2] = 1/sqrt(pi), E[max of 3] = 3/(2 sqrt(pi)) for standard normals
    assert expected_max_std_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_std_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_std_normal(1) == 0.0
    assert 3.8 < expected_max_std_normal(12288) < 4.0  # ~ sqrt(2 ln N) minus its correction


def test_empirical_and_two_point_order_statistics():
    # half the ranks at 0.9, half at 1.1: the maximum of N is 1.1 unless all N drew 0.9
    for n in (1, 2, 5, 40):
        assert expected_max_empirical((0.9, 1.1), n) == pytest.approx(1.1 - 0.2 * 0.5**n)
    # a fraction p of hosts 10% slower: E[excess] = 0.1 (1 - (1 - p)^H)
    slow = SlowHosts(fraction=0.01, slowdown=0.1)
    assert slow.expected_excess(100) == pytest.approx(0.1 * (1 - 0.99**100))
    assert Jitter().expected_max(4096, 512, slow) == pytest.approx(1 + slow.expected_excess(512))


def test_straggler_term_is_the_order_statistic_times_the_busy_time(medium, a100):
    layout = Layout(dp=16, tp=2, pp=2, v=2, micro_batch=2)
    jitter = Features(impl=Implementation(jitter=Jitter(cv=0.02)))
    est = estimate(medium, layout, replace(a100, slow_hosts=SlowHosts()), jitter)
    expected = 0.02 * expected_max_std_normal(64) * busy(est)
    assert est.terms["stragglers"] == pytest.approx(expected)
    off = replace(jitter, effects=Effects.without(["stragglers"]))
    assert estimate(medium, layout, a100, off).terms["stragglers"] == 0.0


def test_collision_closed_form_on_hand_counted_cases():
    # 2 flows on 2 links of capacity 1: same link with probability 1/2 -> E = 1/2 * 1 + 1/2 * 2
    assert congestion.collision_slowdown(2, 2, 1) == pytest.approx(1.5)
    # 3 flows on 3 links: all apart 6/27, all together 3/27, else a pair (18/27)
    assert congestion.max_load_cdf(3, 3, 1) == pytest.approx(6 / 27)
    assert congestion.collision_slowdown(3, 3, 1) == pytest.approx((6 + 2 * 18 + 3 * 3) / 27)
    # two independent switches: P(max <= 1) squares
    p1 = 6 / 27
    p2 = 24 / 27
    two = p1**2 + 2 * (p2**2 - p1**2) + 3 * (1 - p2**2)
    assert congestion.collision_slowdown(3, 3, 1, switches=2) == pytest.approx(two)
    # capacity: 4 flows over 2 links that each carry 2 never collide... unless they pile up
    assert congestion.max_load_cdf(4, 2, 2) == pytest.approx(6 / 16)
    assert congestion.collision_slowdown(2, 8, 2) == 1.0


@pytest.mark.parametrize(
    "layout", [Layout(dp=64, tp=8, pp=4), Layout(dp=128, tp=8, pp=2), Layout(dp=8, tp=8, pp=8)], ids=Layout.label
)
@pytest.mark.parametrize("rails,nodes_per_tor", [(8, 64), (1, 8)])
def test_collision_closed_form_agrees_with_the_flow_simulation(a100, layout, rails, nodes_per_tor):
    """The closed form against ecmp.simulate drawing every flow's hash, on the planner's placement."""
    cluster = a100.with_network(
        flows_per_connection=1, rails=rails, nodes_per_tor=nodes_per_tor, tors_per_pod=32 if rails == 1 else 4
    )
    placed = placement.place(layout, placement.synthetic_hosts(cluster, layout.world // 8), 8)
    for kind, traffic in (("pp", congestion.pp_traffic), ("dp", congestion.dp_traffic)):
        closed = traffic(cluster, layout.dp, layout.tp, layout.pp).slowdown
        drawn = ecmp.simulate(placed, ecmp.Fabric.of(cluster), trials=30, kind=kind).slowdown
        assert closed == pytest.approx(drawn, rel=0.2), (kind, closed, drawn)


def test_bandwidth_falls_with_scale_and_collisions_are_switchable(gpt175b, a100):
    small = congestion.pp_traffic(a100, 4, 8, 8)  # 32 nodes: one rail group
    large = congestion.pp_traffic(a100, 192, 8, 8)  # 1536 nodes: every boundary leaves a group
    assert small.slowdown == 1.0 and large.slowdown > 2.0
    base = comm.p2p_link(a100, 1536)
    assert comm.p2p_link(a100, 1536, 2.0).bytes_per_s == pytest.approx(base.bytes_per_s / 2)
    layout = Layout(dp=192, tp=8, pp=8, v=6)
    work = replace(gpt175b, global_batch=6144)
    on = estimate(work, layout, a100, Features.none())
    off = estimate(work, layout, a100, replace(Features.none(), effects=Effects.without(["collisions"])))
    assert on.terms["pp_exposed"] > 1.5 * off.terms["pp_exposed"]
    assert "slowdown" in on.inputs["collisions_pp"]


def test_interleaving_stops_paying_when_each_chunk_costs(medium, a100):
    space = SearchSpace(tps=(1,), pps=(4,), micro_batches=(1,))
    work = replace(medium, global_batch=64)
    free = search(work, 32, a100, IDEAL, space)[0]
    assert free.layout.v == max(v for v in (1, 2, 3, 6) if 24 // 4 % v == 0)
    costly = replace(
        IDEAL,
        impl=Implementation(chunk_overhead_us=3000.0),
        effects=Effects.without(["stragglers", "collisions", "contention", "launch_gaps", "host"]),
    )
    best = search(work, 32, a100, costly, space)[0]
    assert best.layout.v < free.layout.v
    micro = best.micro_batches
    assert best.terms["interleave"] == pytest.approx(micro * 2 * best.layout.v * 3000e-6)


def test_contention_charges_the_hidden_communication(gpt175b, a100):
    layout = Layout(dp=4, tp=8, pp=8, v=2)
    est = estimate(gpt175b, layout, a100, Features(impl=Implementation(overlap_contention=0.1)))
    t = est.terms
    hidden = sum(est.totals.values()) - t["tp_exposed"] - t["pp_exposed"] - t["dp_exposed"]
    assert hidden > 0
    assert t["contention"] == pytest.approx(0.1 * hidden)
    off = Features(impl=Implementation(overlap_contention=0.1), effects=Effects.without(["contention"]))
    assert estimate(gpt175b, layout, a100, off).terms["contention"] == 0.0


def test_launch_gaps_count_the_kernels(tiny, a100):
    gap = Features(impl=Implementation(launch_gap_us=5.0))
    est = estimate(tiny, Layout(dp=1, micro_batch=2), a100, gap)
    # 2 layers x 14 kernels x (forward + 2x backward) x 5 us, per micro-batch, 4 micro-batches
    assert est.terms["launch_gaps"] == pytest.approx(4 * 2 * 14 * 3 * 5e-6)
    unfused = estimate(tiny, Layout(dp=1, micro_batch=2), a100, replace(gap, fused_elementwise=False))
    assert unfused.terms["launch_gaps"] == pytest.approx(2 * est.terms["launch_gaps"])
    assert unfused.detail["elementwise_fwd"] == pytest.approx(2 * est.detail["elementwise_fwd"])


def test_attention_kernels(gpt175b, a100):
    layout = Layout(dp=4, tp=8, pp=8)
    flash2 = estimate(gpt175b, layout, a100, replace(IDEAL, attention="flash2"))
    flash1 = estimate(gpt175b, layout, a100, replace(IDEAL, attention="flash1"))
    unfused = estimate(gpt175b, layout, a100, replace(IDEAL, attention="unfused"))
    assert flash1.detail["attention_fwd"] == pytest.approx(2 * flash2.detail["attention_fwd"])
    # materialised: QK^T and PV over the full s x s of 12 heads (96 / tp) plus 4 score passes
    m, gpu = gpt175b.model, a100.gpu
    batch, s, d = 12, m.seq_len, m.head_dim
    rate = gpu.peak("bf16") * gpu.gemm_efficiency * d / (d + 64)
    hand = 2 * 2 * batch * s * s * d / rate + 4 * batch * s * s * 2 / gpu.hbm_bytes_per_s
    assert unfused.detail["attention_fwd"] == pytest.approx(hand)
    assert unfused.memory.activations > flash2.memory.activations  # the stored softmax


def test_host_overhead_is_per_step(medium, a100):
    host = Features(impl=Implementation(host_overhead_s=0.25))
    est = estimate(medium, Layout(dp=8, micro_batch=4), a100, host)
    assert est.terms["host"] == 0.25
    off = replace(host, effects=Effects.without(["host"]))
    assert estimate(medium, Layout(dp=8, micro_batch=4), a100, off).terms["host"] == 0.0


def test_unknown_effect_is_named():
    from megascale.config import ConfigError

    with pytest.raises(ConfigError, match="unknown effect.*'wind'"):
        Effects.without(["wind"])
