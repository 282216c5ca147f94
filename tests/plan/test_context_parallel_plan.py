"""The planner's model of context parallelism: cp splits a sequence's tokens (activation memory,
compute per rank), adds ring or halo traffic between cp neighbours and the gradients' all-reduce
over cp, and the search tries cp for long sequences and picks it where it pays."""

from __future__ import annotations

import json

import pytest

from megascale.config import load_config
from megascale.plan.cluster import load_cluster
from megascale.plan.cost import estimate
from megascale.plan.layout import Layout, Workload
from megascale.plan.search import SearchSpace, candidate_layouts, search
from tests.plan.conftest import ROOT


@pytest.fixture
def mistral() -> Workload:
    return Workload.from_job(load_config(ROOT / "configs" / "mistral-7b.toml"), 64)


@pytest.fixture
def h100():
    return load_cluster("h100-8x400g")


def test_cp_is_tried_only_for_long_sequences(mistral, h100):
    short = candidate_layouts(mistral.with_model(seq_len=4096, window=None), 64, h100)
    long = candidate_layouts(mistral.with_model(seq_len=32768, window=None), 64, h100)
    assert {c.cp for c in short} == {1}
    assert {c.cp for c in long} == {1, 2, 4, 8}
    assert all(c.cp * c.tp <= h100.gpus_per_node for c in long)  # cp stays in the node with tp


def test_the_search_picks_cp_for_a_128k_sequence(mistral, h100):
    work = mistral.with_model(seq_len=131072, window=None)
    best = search(work, 64, h100)[0]
    without = search(work, 64, h100, space=SearchSpace(cps=(1,)))[0]
    assert best.layout.cp > 1
    assert best.step_time < without.step_time
    assert 0 < best.terms["cp_exposed"] < 0.01 * best.step_time  # ring traffic hidden behind attention


def test_cp_halves_a_ranks_tokens_and_adds_its_traffic(mistral, h100):
    work = mistral.with_model(seq_len=131072, window=None)
    one, two = (estimate(work, Layout(dp=4, tp=8, cp=cp, recompute="full"), h100) for cp in (1, 2))
    assert two.memory.activations == pytest.approx(one.memory.activations / 2, rel=1e-9)
    assert two.detail["fwd_mb"] < 0.55 * one.detail["fwd_mb"]
    assert one.totals["cp"] == one.terms["cp_exposed"] == 0
    assert two.totals["cp"] >= two.terms["cp_exposed"] > 0
    halo = estimate(work.with_model(window=4096), Layout(dp=4, tp=8, cp=2, recompute="full"), h100)
    assert 0 < halo.totals["cp"] < two.totals["cp"] / 4  # 4095 positions a layer instead of 65536


def test_a_cp_layout_round_trips_through_the_job_config():
    cfg = load_config(ROOT / "configs" / "long-context-32k.toml")
    layout = Layout.from_job(cfg)
    assert layout.cp == 4 and "--parallel.cp=4" in layout.overrides() and "cp=4" in layout.label()


def test_the_jobs_memory_limit_makes_the_search_pick_cp(tmp_path, capsys):
    """A 64k sequence on 8 H100s: the best layout holds 72 GiB at cp1; under the job's own limit of
    60 GiB (train.memory_limit_gib) the search keeps only what fits it and picks cp."""
    from megascale.cli import main

    def best(*extra: str) -> dict:
        out = tmp_path / "plan.json"
        args = ["plan", "--config", str(ROOT / "configs" / "mistral-7b.toml"), "--cluster", "h100-8x400g"]
        args += ["--gpus", "8", "--batch", "8", "--model.seq_len=65536", "--model.window=none", "--json", str(out)]
        assert main([*args, *extra]) == 0
        return json.loads(out.read_text())["ranking"]

    free, limited = best(), best("--train.memory_limit_gib=60")
    assert free[0]["layout"]["cp"] == 1 and free[0]["memory_gib"]["total"] > 60
    assert limited[0]["layout"]["cp"] > 1
    reserved = limited[0]["memory_gib"]["reserved"]
    assert all(r["memory_gib"]["total"] - reserved <= 60 for r in limited)
    assert "train.memory_limit_gib=60" in capsys.readouterr().out
