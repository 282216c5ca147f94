"""Shared workloads and clusters for the planner's tests (pure arithmetic, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megascale.config import ModelConfig, load_config
from megascale.plan.cluster import load_cluster
from megascale.plan.layout import Workload

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny() -> Workload:
    """The hand-computed model: 2 serial layers, hidden 8, 2 heads, MLP 32, vocab 100, seq 16."""
    model = ModelConfig(vocab_size=100, seq_len=16, layers=2, hidden=8, heads=2, block="serial", positions="learned")
    return Workload(model=model, global_batch=8, dtype="bf16", optimizer="adamw")


@pytest.fixture
def gpt175b() -> Workload:
    return Workload.from_job(load_config(ROOT / "configs" / "gpt-175b.toml"), 768)


@pytest.fixture
def medium() -> Workload:
    """A 1.3B-class model that fits anywhere, so memory never forces recomputation."""
    model = ModelConfig(vocab_size=51200, seq_len=2048, layers=24, hidden=2048, heads=16, positions="learned")
    return Workload(model=model, global_batch=512)


@pytest.fixture
def a100():
    return load_cluster("a100-8x200g")


@pytest.fixture
def flat8(a100):
    """The same nodes under one ToR switch per 8 nodes (no rails): small ToRs, many crossings."""
    return a100.with_network(nodes_per_tor=8, tors_per_pod=32, rails=1)
