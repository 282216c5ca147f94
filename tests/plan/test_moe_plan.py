"""The planner's MoE model (plan/moe.py) on a Mixtral-8x7B-shaped workload: memory holds the
routed experts over ep, compute counts the top_k experts a token runs, the all-to-alls cross
the links of the ep group, and the search picks ep when the experts do not fit without it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megascale.config.schema import ModelConfig, MoEConfig
from megascale.model.flops import mlp_parameters
from megascale.plan import comm
from megascale.plan.cluster import load_cluster
from megascale.plan.cost import estimate
from megascale.plan.layout import Features, Layout, Workload
from megascale.plan.search import SearchSpace, search

MIXTRAL = ModelConfig(
    vocab_size=32000,
    seq_len=4096,
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    ffn_hidden=14336,
    block="serial",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    moe=MoEConfig(experts=8, top_k=2),
)
WORK = Workload(model=MIXTRAL, global_batch=64, optimizer="adamw")


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-8x400g")


def _moe(**changes) -> Workload:
    return replace(WORK, model=replace(MIXTRAL, moe=replace(MIXTRAL.moe, **changes)))


def test_memory_holds_the_routed_experts_over_ep_and_zero_shards_the_same_state(h100):
    one, eight = (estimate(WORK, Layout(dp=64, ep=ep), h100).memory for ep in (1, 8))
    routed = MIXTRAL.layers * 8 * mlp_parameters(MIXTRAL, 14336)  # 45.1e9 of the 46.7e9
    assert one.params - eight.params == pytest.approx(2 * routed * (1 - 1 / 8))  # bf16, unsharded in ZeRO-2
    assert one.optimizer == pytest.approx(eight.optimizer)  # experts' state over dp/ep, dense over dp
    assert not one.fits and eight.fits


def test_compute_counts_the_top_k_experts_not_every_expert_held(h100):
    layout = Layout(dp=8, ep=8)
    compute = {
        (experts, k): estimate(_moe(experts=experts, top_k=k), layout, h100).terms["compute"]
        for experts, k in ((8, 2), (16, 2), (8, 8))
    }
    assert compute[(16, 2)] == pytest.approx(compute[(8, 2)], rel=0.05)  # twice the experts, same work
    assert compute[(8, 8)] > 2.5 * compute[(8, 2)]  # every expert active: ~4x the MLP work


def test_all_to_alls_move_top_k_rows_over_the_ep_groups_links(h100):
    for tp, scope in ((1, "node"), (8, "tor")):  # ep group stride tp: inside a node, or over 8 nodes
        layout = Layout(dp=8, tp=tp, ep=8)
        est = estimate(WORK, layout, h100)
        link = comm.group_link(h100, 8, tp)
        assert link.scope == scope
        rows = layout.micro_batch * MIXTRAL.seq_len / tp * 2  # this rank's tokens (SP), top-2 copies
        a2a = comm.all_to_all_time(8, rows * MIXTRAL.hidden * 2, link)
        assert est.detail["ep_all_to_all"] == pytest.approx(a2a)
        assert est.totals["ep"] == pytest.approx(est.micro_batches * MIXTRAL.layers * 4 * a2a)
        hidden_some = est.terms["ep_exposed"]
        off = estimate(WORK, layout, h100, Features(ep_overlap=False))
        assert off.terms["ep_exposed"] == pytest.approx(off.totals["ep"]) and hidden_some < off.terms["ep_exposed"]
    assert estimate(WORK, Layout(dp=8, tp=8, ep=1), h100).totals["ep"] == 0.0


def test_the_experts_zero_traffic_runs_over_their_expert_data_group(h100):
    """At ep = 8 of dp = 64 each rank gathers and reduce-scatters 1 expert per MoE layer over 8
    ranks 8 apart (one per node: one NIC each), against 8 experts over 64 ranks at ep = 1."""
    from megascale.plan.moe import expert_dp_times

    unit = mlp_parameters(MIXTRAL, 14336)  # one expert
    for ep, experts in ((1, 8), (8, 1)):
        layout = Layout(dp=64, ep=ep)
        link = comm.group_link(h100, 64 // ep, ep)
        got = expert_dp_times(WORK, layout, h100, 1.0, 2, 2)
        assert got.all_gather == pytest.approx(
            MIXTRAL.layers * comm.all_gather_time(64 // ep, experts * unit * 2, link)
        )
    one, eight = (estimate(WORK, Layout(dp=64, ep=ep), h100) for ep in (1, 8))
    assert eight.totals["dp"] < 0.9 * one.totals["dp"] and eight.terms["dp_exposed"] < one.terms["dp_exposed"]


def test_search_chooses_ep_when_the_experts_fit_only_split(h100):
    space = SearchSpace(tps=(1,), pps=(1,))  # dp only: ep is the one way to split the experts
    best = search(WORK, 64, h100, space=space)
    assert best and all(e.layout.ep > 1 for e in best)
    assert best[0].layout.overrides()[-1] == f"--parallel.ep={best[0].layout.ep}"
    small = Workload(model=replace(MIXTRAL, layers=2, hidden=1024, heads=8, ffn_hidden=2048), global_batch=64)
    fastest = search(small, 8, h100, space=space)[0].layout
    assert fastest.ep == 1  # fits either way: here ep's all-to-alls cost more than its dp traffic saves


def test_under_cp_a_rank_routes_its_part_of_each_sequence_over_ep_ranks_tp_cp_apart(h100):
    """cp=4 quarters the rows each rank sends to the experts, and moves the ep group's members
    (dp ranks, tp * cp apart) from one node to four; the expert-data group is tp * cp * ep apart."""
    from megascale.plan.moe import expert_dp_times

    long = replace(WORK, model=replace(MIXTRAL, seq_len=32768))
    for cp, scope in ((1, "node"), (4, "tor")):
        est = estimate(long, Layout(dp=8, tp=2, cp=cp, ep=4), h100)
        link = comm.group_link(h100, 4, 2 * cp)
        assert link.scope == scope
        rows = 32768 / cp / 2 * 2  # this rank's part of the sequence (cp), its SP slice (tp), top-2
        assert est.detail["ep_all_to_all"] == pytest.approx(comm.all_to_all_time(4, rows * MIXTRAL.hidden * 2, link))
    got = expert_dp_times(long, Layout(dp=16, tp=2, cp=2, ep=2), h100, 1.0, 2, 2)
    unit = 4 * mlp_parameters(MIXTRAL, 14336)  # 8 experts / ep 2 a rank
    edp = comm.group_link(h100, 8, 2 * 2 * 2)
    assert got.all_gather == pytest.approx(MIXTRAL.layers * comm.all_gather_time(8, unit * 2, edp))
