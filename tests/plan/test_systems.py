"""System presets, fixed-layout evaluation, FLOP conventions and the ablation on one layout."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megascale.cli import main
from megascale.config import ConfigError
from megascale.plan.cli import evaluate, parse_layout
from megascale.plan.cost import estimate
from megascale.plan.flops import training_flops_per_token
from megascale.plan.layout import Features, Layout
from megascale.plan.search import SearchSpace, ablate, search
from megascale.plan.system import ABLATION, list_systems, load_system

ROOT = Path(__file__).resolve().parents[2]
GPT175 = str(ROOT / "configs/gpt-175b.toml")


def test_presets_state_the_switches():
    assert {"megascale", "megatron", "megatron-2021"} <= set(list_systems())
    ms, mt = load_system("megascale"), load_system("megatron")
    assert (ms.block, mt.block) == ("parallel", "serial")
    assert (ms.window, mt.window) == (1024, None)
    assert ms.features.tp_overlap and not mt.features.tp_overlap
    assert (ms.features.attention, mt.features.attention) == ("flash2", "flash1")
    assert mt.features.impl.grad_wire_bytes == 4  # bf16 -> fp32 gradient reduction
    old = load_system("megatron-2021")  # extends megatron: same constants, stated differences
    assert old.features.impl.chunk_overhead_us == mt.features.impl.chunk_overhead_us
    assert (old.features.attention, old.zero) == ("unfused", 0)


def test_system_errors_name_the_key(tmp_path):
    bad = tmp_path / "sys.toml"
    bad.write_text('extends = "megascale"\n[operators]\nattention = "magic"\n')
    with pytest.raises(ConfigError, match="operators.attention"):
        load_system(str(bad))
    bad.write_text("[implementation]\nlaunch_gap = 3\n")
    with pytest.raises(ConfigError, match="unknown key.*launch_gap"):
        load_system(str(bad))
    with pytest.raises(ConfigError, match="presets"):
        load_system("no-such-system")


def test_flop_conventions_by_hand(tiny):
    # tiny: dense 3072, head 1600, causal attention 544 per token forward (test_terms.py)
    m = tiny.model
    assert training_flops_per_token(m, "causal") == 3 * (3072 + 544 + 1600)
    full_attention = 2 * 2 * 2 * 16 * 8  # layers x 2 GEMMs x 2 FLOPs x seq x hidden
    assert training_flops_per_token(m, "full") == 3 * (3072 + full_attention + 1600)
    assert training_flops_per_token(m, "megatron", "full") == (4 * (3072 + full_attention) + 3 * 1600)
    windowed = replace(m, window=4)
    assert training_flops_per_token(windowed, "full") == 3 * (3072 + 2 * 2 * 2 * 4 * 8 + 1600)


def test_megatron_convention_is_narayanan_equation_3(gpt175b):
    """F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration (SC'21, eq. 3), for a 4h MLP."""
    m = gpt175b.model
    b, s, layers, h, v = 1536, m.seq_len, m.layers, m.hidden, m.vocab_size
    eq3 = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    ours = b * s * training_flops_per_token(m, "megatron", "full")
    assert ours == pytest.approx(eq3, rel=1e-12)


def test_layout_agrees_with_the_search(gpt175b, a100):
    features = load_system("megascale").features
    results = search(gpt175b, 256, a100, features, SearchSpace(zero_stages=(1, 2)))
    for found in results[:4] + results[-2:]:
        lay = found.layout
        text = f"tp={lay.tp},pp={lay.pp},v={lay.v},mb={lay.micro_batch},zero={lay.zero},schedule={lay.schedule}"
        layout, rc_given = parse_layout(text, Layout(dp=1), gpus=256)
        assert not rc_given and layout.dp == lay.dp
        same = evaluate(gpt175b, layout, a100, features, rc_given)
        assert same.layout == lay
        assert same.step_time == found.step_time and same.terms == found.terms
    with pytest.raises(ConfigError, match="uses 512 GPUs"):
        parse_layout("dp=8,tp=8,pp=8", Layout(dp=1), gpus=256)
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_layout("tp=eight", Layout(dp=1))


def test_cli_layout_and_system(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = [
        "plan",
        "--model",
        GPT175,
        "--gpus",
        "256",
        "--batch",
        "768",
        "--layout",
        "tp=8,pp=8,v=6,mb=1,rc=none",
        "--json",
        str(out),
    ]
    assert main([*args, "--system", "megatron"]) == 0
    megatron = json.loads(out.read_text())["layout"]
    assert main([*args, "--system", "megascale"]) == 0
    megascale = json.loads(out.read_text())["layout"]
    assert megatron["layout"]["dp"] == megascale["layout"]["dp"] == 4
    assert megatron["layout"]["zero"] == 1 and megascale["layout"]["zero"] == 2
    assert megascale["mfu_by_convention"]["full"] > megatron["mfu_by_convention"]["full"] + 0.05
    assert main([*args, "--without", "stragglers,host,launch_gaps"]) == 0
    assert json.loads(out.read_text())["layout"]["breakdown_s"]["stragglers"] == 0.0
    assert main([*args, "--without", "wind"]) == 2
    assert "unknown effect" in capsys.readouterr().out


def test_ablation_on_a_fixed_layout(gpt175b, a100):
    base, target = load_system("megatron"), load_system("megascale")
    layout = Layout(dp=4, tp=8, pp=8, v=6, micro_batch=1, zero=1)
    work = replace(gpt175b, global_batch=768)
    rows = ablate(work, 256, a100, base, target, lamb_scale=3, layout=layout)
    assert [r.name for r in rows] == ["baseline", *(a[0] for a in ABLATION), "LAMB, batch x3"]
    assert all(r.cumulative.layout == layout for r in rows)
    assert rows[0].cumulative.micro_batches == 64 and rows[-1].cumulative.micro_batches == 192
    # each step alone starts from the baseline; cumulatively they reach the target system
    # (with AdamW: LAMB comes last, with its larger batch)
    first = rows[1]
    assert first.alone.step_time == first.cumulative.step_time
    adam_target = replace(target, optimizer="adamw")
    final = estimate(adam_target.apply(replace(work, global_batch=256)), layout, a100, target.features)
    assert rows[-2].cumulative.step_time == pytest.approx(final.step_time)
    mfus = [r.cumulative.mfu_in("full") for r in rows]
    assert mfus[-1] > mfus[0] + 0.1


def test_cli_ablate_uses_the_given_layout(tmp_path):
    out = tmp_path / "a.json"
    assert (
        main(
            [
                "plan",
                "--model",
                GPT175,
                "--gpus",
                "256",
                "--batch",
                "768",
                "--layout",
                "dp=4,tp=8,pp=8,v=6,mb=1,zero=1",
                "--ablate",
                "--lamb-scale",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["ablation"]
    assert rows[0]["name"] == "baseline" and len(rows) == len(ABLATION) + 2


def test_features_default_is_ideal_implementation(gpt175b, a100):
    """Without a system the implementation constants are zero: the old upper-bound model."""
    est = estimate(gpt175b, Layout(dp=4, tp=8, pp=8, v=2), a100, Features())
    assert est.terms["host"] == est.terms["launch_gaps"] == est.terms["contention"] == 0.0
