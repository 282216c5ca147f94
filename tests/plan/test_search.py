"""Layout search, ablation and the CLI that prints them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megascale.cli import main
from megascale.config import ConfigError
from megascale.plan.cluster import GIB, list_presets, load_cluster
from megascale.plan.comm import all_gather_time, chunked_overlap_exposed, group_link, group_span
from megascale.plan.layout import Layout
from megascale.plan.search import ablate, candidate_layouts, search
from megascale.plan.system import load_system

ROOT = Path(__file__).resolve().parents[2]


def test_presets_load_and_extend():
    names = list_presets()
    assert {"a100-8x200g", "a100-8x400g", "h100-8x400g", "h200-8x400g"} <= set(names)
    a100, h200 = load_cluster("a100-8x200g"), load_cluster("h200-8x400g")
    assert a100.node.nic_bytes_per_s == 25e9 and h200.node.nic_bytes_per_s == 50e9
    assert h200.gpu.memory_bytes == 141 * GIB
    assert h200.node.nvlink_bytes_per_s == load_cluster("h100-8x400g").node.nvlink_bytes_per_s


def test_cluster_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        (ROOT / "configs/clusters/a100-8x200g.toml").read_text().replace("memory_gib = 80", "memory_gib = -1")
    )
    with pytest.raises(ConfigError, match="gpu.memory_gib"):
        load_cluster(str(bad))
    with pytest.raises(ConfigError, match="presets"):
        load_cluster("no-such-cluster")


def test_ring_formulas_and_spans(a100, flat8):
    link = group_link(a100, 8, 1)
    assert link.scope == "node"
    assert all_gather_time(8, 8e9, link) == pytest.approx(7 / 8 * 8e9 / 230e9 + 7 * 3e-6)
    span = group_span(flat8, 384, 4)  # dp=384 over tp=4: two members per node
    assert (span.per_node, span.nodes, span.tors) == (2, 192, 24)
    assert group_span(a100, 384, 4).tors == 3  # 64 nodes per rail group
    cross = group_link(a100, 384, 4)
    assert cross.bytes_per_s == pytest.approx(2 * 25e9 * 0.85)
    for comm_t, gemm_t in [(1.0, 0.1), (0.1, 1.0), (1.0, 1.0)]:
        exposed = chunked_overlap_exposed(comm_t, gemm_t, gemm_t / 4 * 1.01, 4)
        assert 0 <= exposed <= comm_t


def test_candidates_respect_the_trainer(gpt175b, a100):
    layouts = candidate_layouts(gpt175b, 256, a100)
    assert layouts
    for layout in layouts:
        assert layout.world == 256 and layout.tp <= 8
        assert 96 % (layout.pp * layout.v) == 0 and 96 % layout.tp == 0
        if layout.v > 1 and layout.schedule == "1f1b":
            assert layout.micro_batches(768) % layout.pp == 0


def test_search_ranks_fitting_layouts(gpt175b, a100):
    results = search(gpt175b, 256, a100)
    assert results and all(r.fits for r in results)
    times = [r.step_time for r in results]
    assert times == sorted(times)
    assert 0.3 < results[0].mfu < 0.8
    assert not search(gpt175b, 8, a100)  # 175B cannot fit on one node


def test_ablation_turns_each_on(gpt175b, a100):
    base, target = load_system("megatron"), load_system("megascale")
    rows = ablate(gpt175b, 256, a100, base, target, lamb_scale=4)
    names = [r.name for r in rows]
    assert names[0] == "baseline" and names[-1].startswith("LAMB") and len(rows) == 9
    assert rows[-1].cumulative.mfu_in("full") > rows[0].cumulative.mfu_in("full")
    assert {r.cumulative.layout for r in rows} == {rows[0].cumulative.layout}
    assert rows[-1].cumulative.micro_batches == 4 * rows[0].cumulative.micro_batches
    # the last system step is the target system, the first is the baseline
    assert rows[-2].cumulative.features == target.features
    assert rows[0].cumulative.features == base.features


def test_cli_plan_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--model",
            str(ROOT / "configs/gpt-175b.toml"),
            "--cluster",
            "a100-8x200g",
            "--gpus",
            "256",
            "--batch",
            "768",
            "--top",
            "3",
            "--explain",
            "--placement",
            "--ecmp",
            "--ecmp-trials",
            "3",
            "--env",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert "MFU" in text and "bubble / busy" in text and "NCCL_IB_TIMEOUT" in text
    data = json.loads(out.read_text())
    assert len(data["ranking"]) == 3 and data["explain"] == data["ranking"][0]
    assert set(data["explain"]["mfu_by_convention"]) == {"causal", "full", "megatron"}
    assert len(data["ecmp"]) == 4


def test_cli_explain_layout_skips_the_search(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--model",
            str(ROOT / "configs/gpt-175b.toml"),
            "--gpus",
            "256",
            "--batch",
            "768",
            "--explain",
            "dp=4,tp=8,pp=8,v=2",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert "ranking" not in data
    assert data["explain"]["layout"] == {
        "dp": 4,
        "tp": 8,
        "pp": 8,
        "v": 2,
        "micro_batch": 1,
        "zero": 2,
        "recompute": "none",
        "cp": 1,
        "ep": 1,
        "schedule": "1f1b",
    }


def test_cli_rejects_bad_layout(capsys):
    code = main(
        [
            "plan",
            "--model",
            str(ROOT / "configs/gpt-175b.toml"),
            "--gpus",
            "256",
            "--batch",
            "768",
            "--explain",
            "dp=4,tp=3,pp=8",
        ]
    )
    assert code == 2
    assert "tp" in capsys.readouterr().out


def test_layout_overrides_round_trip():
    layout = Layout(dp=2, tp=1, pp=1)
    assert "--parallel.dp=2" in layout.overrides()


def test_oversubscription_limits_only_sparse_groups(a100):
    over = a100.with_network(oversubscription=(4.0, 1.0))
    dense = (256, 8)  # dp=256 over tp=8: 8 members under each 8-node ToR
    sparse = (4, 512)  # 4 members 64 nodes apart: one per ToR
    assert group_link(over, *dense).bytes_per_s == group_link(a100, *dense).bytes_per_s
    assert group_link(over, *sparse).bytes_per_s == pytest.approx(group_link(a100, *sparse).bytes_per_s / 4)
    assert group_link(a100, *sparse, network_slowdown=2.0).bytes_per_s == pytest.approx(
        group_link(a100, *sparse).bytes_per_s / 2
    )


def test_cli_placement_from_host_file(tmp_path, capsys):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("".join(f"n{i} {i % 5} 0\n" for i in range(40)))  # 5 ToRs, interleaved
    order = tmp_path / "order.txt"
    code = main(
        [
            "plan",
            "--model",
            str(ROOT / "configs/gpt-175b.toml"),
            "--gpus",
            "256",
            "--batch",
            "768",
            "--top",
            "1",
            "--hosts",
            str(hosts),
            "--placement-out",
            str(order),
        ]
    )
    assert code == 0
    names = order.read_text().split()
    assert len(names) == 32 and len(set(names)) == 32
    assert "dp group spans" in capsys.readouterr().out
