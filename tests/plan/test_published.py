"""The planner out of sample: published runs no constant was fitted to (bench/plan_published.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench/

from bench.plan_published import HELD_OUT, HELD_OUT_POINTS, ROWS, evaluate_rows  # noqa: E402


def test_held_out_rows_are_not_in_the_fitted_set():
    assert not {r.id for r in HELD_OUT} & {r.id for r in ROWS}
    assert all("2205.05198" in r.source for r in HELD_OUT)  # the source is named


def test_held_out_error_within_the_stated_bound():
    """Korthikanti et al. 2022's 530B on 2240 A100s (selective and full recomputation),
    predicted with the megatron-2021 constants fitted on the other rows: within +-6 points."""
    rows = evaluate_rows(None, HELD_OUT)
    assert len(rows) == 2
    for r in rows:
        assert abs(r["error_points"]) <= HELD_OUT_POINTS, r
