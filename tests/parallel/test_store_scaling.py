"""Store operations per rank: constant for local group creation, growing for the naive way.

The worlds 4, 8, 16 have the same groups per rank (a tp group of 2 and a dp group of 2; pp
grows), so a creation scheme that costs O(own groups) per rank shows the same count in all
three, while Megatron-style creation (every rank enters every group's creation, global barrier
after each) grows with the number of groups in the world: O(n) per rank, O(n^2) in total.
"""

import sys
from pathlib import Path

import pytest

from megascale.testing.launch import run_local

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench/
from bench.startup import LAYOUTS, creation_ops  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_local_creation_ops_constant_while_naive_grows():
    local, naive = {}, {}
    for world in (4, 8, 16):
        ranks = run_local(creation_ops, world, (LAYOUTS[world], ("tp", "dp")), timeout_s=600)
        local[world] = {r["local"]["ops"] for r in ranks}
        naive[world] = max(r["naive"]["ops"] for r in ranks)
        assert all(r["local"]["barriers"] == 0 and r["local"]["groups"] == 2 for r in ranks)
        # naive: one global barrier per group of the world (world/2 tp + world/2 dp groups)
        assert all(r["naive"]["barriers"] == world for r in ranks)
    assert len(local[4]) == 1, local  # every rank pays the same ...
    assert local[4] == local[8] == local[16], local  # ... whatever the world size
    assert naive[4] < naive[8] < naive[16], naive
    assert naive[16] >= 2 * naive[4]  # linear in the world per rank, not a constant
