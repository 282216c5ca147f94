"""Restore planning at a few hundred ranks, on the synthetic 175B GPT of `bench/scale_restore.py`
(issue 37 item 7): the work each rank receives and walks (its `Part`) must not grow with the
world, and rank 0's plan must visit each record and target a bounded number of times. Before,
every rank scanned every record for every destination: its loops grew with world x records."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from megascale.checkpoint.plan import Plan, part_size

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench/
from bench.scale_restore import synthetic_manifest, wanted  # noqa: E402

PP, TP, LAYERS = 8, 8, 16  # 175B's widths, 2 layers a stage: the plan's work is per piece, not per byte


def plan_of(saved_dp: int, load_dp: int) -> tuple[dict, Plan, dict]:
    manifest = synthetic_manifest(PP, saved_dp, TP, LAYERS)
    manifest["manifest_bytes"] = 0
    targets = wanted(PP, load_dp, TP, LAYERS)
    plan = Plan(manifest, targets)
    return manifest, plan, plan.parts()


def test_per_rank_plan_work_does_not_grow_with_the_world():
    seen = {}
    for dp in (1, 4):  # 64 and 256 ranks, the same layout saved and loaded
        manifest, plan, parts = plan_of(dp, dp)
        work = plan.visits / (len(manifest["tensors"]) + sum(len(t) for t in wanted(PP, dp, TP, LAYERS)))
        seen[dp] = (max(part_size(p) for p in parts.values()), round(work, 6), len(plan.owner))
    assert seen[1] == seen[4], seen  # the largest part, rank 0's visits per item, no owners at all
    assert seen[1][2] == 0


def test_a_reshard_plan_is_consistent_and_linear():
    """256 -> 128 ranks (dp4 -> dp2): every field is put together on one owner; each pair of
    ranks agrees on what moves between them; every target is filled exactly once."""
    manifest, plan, parts = plan_of(4, 2)
    targets = wanted(PP, 2, TP, LAYERS)
    items = len(manifest["tensors"]) + sum(len(t) for t in targets)
    assert plan.visits <= 3 * items  # linear in the checkpoint and the targets
    sent, got = Counter(), Counter()
    for rank, part in parts.items():
        for s in part["sends"]:
            sent[(rank, s["dst"])] += s["nbytes"]
        for i in part["incoming"]:
            got[(i["src"], rank)] += i["nbytes"]
    assert sent == got
    cut, filled = Counter(), Counter()
    for rank, part in parts.items():
        cut.update((c["dst"], rank) for c in part["cuts"])
        filled.update((rank, f["src"]) for f in part["fills"])
    assert cut == filled
    for rank, part in parts.items():
        assert sorted(f["index"] for f in part["fills"]) == list(range(len(targets[rank])))
    assert len({plan.owner[key] for key in plan.owner}) > 1  # spread, not all on one rank
