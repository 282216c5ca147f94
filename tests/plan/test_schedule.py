"""Pipeline bubble and the monotonic sanity of the cost model."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from megascale.plan.cost import estimate
from megascale.plan.layout import Features, Layout
from megascale.plan.search import SearchSpace, candidate_layouts, search


@pytest.mark.parametrize("pp,v,mb", [(2, 1, 1), (4, 1, 2), (4, 2, 1), (8, 3, 1), (8, 12, 2)])
def test_bubble_is_fraction_of_compute(gpt175b, a100, pp, v, mb):
    layout = Layout(dp=256 // (8 * pp), tp=8, pp=pp, v=v, micro_batch=mb)
    est = estimate(gpt175b, layout, a100)
    m, t = est.micro_batches, est.terms
    busy = t["compute"] + t["tp_exposed"] + t["launch_gaps"] + t["interleave"]
    assert t["bubble"] == pytest.approx((pp - 1) / (v * m) * busy)


def test_bubble_without_tensor_parallelism_is_exactly_compute_fraction(medium, a100):
    est = estimate(medium, Layout(dp=2, tp=1, pp=4, v=3, micro_batch=4), a100)
    assert est.terms["tp_exposed"] == 0
    assert est.terms["bubble"] == pytest.approx(3 / (3 * est.micro_batches) * est.terms["compute"])
    assert estimate(medium, Layout(dp=8, micro_batch=4), a100).terms["bubble"] == 0


def test_more_gpus_never_raise_efficiency_same_shape(medium, a100):
    """Growing dp at a fixed batch shrinks m (more bubble) and lengthens the DP ring."""
    for tp, pp, v in [(1, 1, 1), (2, 2, 2), (8, 4, 1)]:
        mfus = []
        for dp in (1, 2, 4, 8, 16):
            layout = Layout(dp=dp, tp=tp, pp=pp, v=v, micro_batch=1)
            mfus.append(estimate(medium, layout, a100).mfu)
        assert all(b <= a + 1e-12 for a, b in itertools.pairwise(mfus)), (tp, pp, mfus)


@pytest.mark.parametrize(
    "workload,counts", [("medium", (8, 16, 32, 64, 128, 256, 512)), ("gpt175b", (256, 512, 1024, 2048))]
)
def test_more_gpus_never_raise_best_efficiency(request, a100, workload, counts):
    work = request.getfixturevalue(workload)
    best = [search(work, n, a100)[0].mfu for n in counts]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(best)), best


OVERLAPS = (
    {"tp_overlap": True},
    {"pp_overlap": True},
    {"dp_overlap": True},
    {"data_overlap": True},
    {"dp_overlap": True, "data_overlap": True},
)


def test_turning_an_overlap_on_never_slows_the_step(gpt175b, medium, a100):
    checked = 0
    for work, gpus in ((gpt175b, 256), (medium, 64)):
        layouts = candidate_layouts(work, gpus, a100)[::7]
        for layout, base_on in itertools.product(layouts, (False, True)):
            base = Features() if base_on else Features.none()
            for change in OVERLAPS:
                off = replace(base, **{k: False for k in change})
                on = replace(base, **change)
                t_off = estimate(work, layout, a100, off).step_time
                t_on = estimate(work, layout, a100, on).step_time
                assert t_on <= t_off * (1 + 1e-12), (layout, change, base_on)
                checked += 1
    assert checked > 100


def test_overlaps_hide_communication_at_scale(gpt175b, a100):
    layout = Layout(dp=4, tp=8, pp=8, v=2)
    on = estimate(gpt175b, layout, a100, Features()).terms
    off = estimate(gpt175b, layout, a100, Features.none())
    assert on["dp_exposed"] < off.terms["dp_exposed"] and on["pp_exposed"] < off.terms["pp_exposed"]
    assert on["tp_exposed"] < off.terms["tp_exposed"]
    assert off.terms["dp_exposed"] == pytest.approx(off.totals["dp"])
    assert off.terms["pp_exposed"] == pytest.approx(off.totals["pp"])


@pytest.mark.parametrize("pp,mb", [(2, 1), (4, 2), (8, 1)])
def test_zero_bubble_bubbles(gpt175b, a100, pp, mb):
    """ZB-H1 idles (p-1)(F + recompute) per step, (p-1)/(3m) of the busy time when the backward
    is twice the forward; ZB-V half of that; interleaved 1F1B (p-1)/(v m)."""
    layout = Layout(dp=256 // (8 * pp), tp=8, pp=pp, micro_batch=mb, recompute="none")
    plain = estimate(gpt175b, layout, a100)
    zb = estimate(gpt175b, replace(layout, schedule="zb-h1"), a100)
    zbv = estimate(gpt175b, replace(layout, v=2, schedule="zbv"), a100)
    for est in (zb, zbv):
        assert est.terms["compute"] == pytest.approx(plain.terms["compute"])
    # 1F1B idles (p-1) micro-batches of busy time, ZB-H1 (p-1) forwards: a third, B = 2F
    assert zb.terms["bubble"] == pytest.approx(plain.terms["bubble"] / 3, rel=0.02)
    assert zbv.terms["bubble"] == pytest.approx(zb.terms["bubble"] / 2, rel=0.05)


def test_search_may_pick_a_zero_bubble_schedule(medium, a100):
    """With few micro-batches and deep pipelines, ZB beats interleaving in the search; every
    zero-bubble candidate has enough micro-batches (ZB-H1 m >= p, ZB-V m >= 2p-1)."""
    space = SearchSpace(pps=(4,), tps=(1,), micro_batches=(4,), virtuals=(1, 2))
    found = search(medium, 64, a100, space=space)
    kinds = {r.layout.schedule for r in found}
    assert kinds == {"1f1b", "zb-h1", "zbv"}
    assert found[0].layout.schedule in ("zb-h1", "zbv")
    only_1f1b = search(medium, 64, a100, space=replace(space, schedules=("1f1b",)))
    assert found[0].step_time < only_1f1b[0].step_time
    for r in found:
        if r.layout.schedule != "1f1b":
            need = r.layout.pp if r.layout.schedule == "zb-h1" else 2 * r.layout.pp - 1
            assert r.micro_batches >= need
