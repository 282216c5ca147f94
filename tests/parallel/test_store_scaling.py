"""Store operations per rank: constant for local group creation, growing for the naive way.

The worlds 4, 8, 16 have the same groups per rank (a tp group of 2 and a dp group of 2; pp
grows), so a creation scheme that costs O(own groups) per rank shows the same count in all
three, while Megatron-style creation (every rank enters every group's creation, global barrier
after each) grows with the number of groups in the world: O(n) per rank, O(n^2) in total.
"""

import sys
from pathlib import Path

import pytest
import torch

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


def _side_group_ops(layout: tuple[int, int, int]) -> dict:
    """One rank: store ops of its checkpoint groups, of its replica groups, and (for scale) of one
    world-sized gloo group, the way both side groups were made before; the groups work."""
    import torch.distributed as dist

    from megascale.checkpoint.comm import Comm
    from megascale.config import ParallelConfig
    from megascale.parallel import init_mesh

    mesh = init_mesh(ParallelConfig(pp=layout[0], dp=layout[1], tp=layout[2], backend="gloo"), device="cpu")
    try:
        counter, out = mesh.store, {}
        for name, make in (
            ("checkpoint", lambda: mesh.checkpoint_groups),
            ("replica", lambda: mesh.replica_groups),
            (
                "world",
                lambda: dist.new_group(list(range(mesh.world_size)), backend="gloo", use_local_synchronization=True),
            ),
        ):
            counter.reset()
            make()
            out[name] = counter.total_ops
        comm = Comm(mesh.grid, mesh.rank, mesh.replica_groups)
        out["sum"] = comm.all_reduce([mesh.rank], "sum")[0]
        out["ring"] = sorted(
            comm.exchange({(mesh.rank + 1) % mesh.world_size: torch.ones(mesh.rank + 1, dtype=torch.uint8)}).items()
        )
        out["ring"] = [(src, int(t.numel())) for src, t in out["ring"]]
        return out
    finally:
        mesh.destroy()


def test_checkpoint_and_replica_groups_cost_what_their_size_needs_not_the_world():
    """Issue 37 item 8: the checkpoint and replica groups spanned the world (2W+1 store ops and W+3
    sockets per rank each). Now each is a gloo twin of the rank's tp, dp and pp groups (here all of
    two ranks), so a rank's ops are a fixed price per group whatever the world, while one world
    group's grow; world collectives and any-to-any messages still work over them (routed)."""
    per_group = {}
    for world, layout, dims in ((4, (1, 2, 2), 2), (8, (2, 2, 2), 3)):
        ranks = run_local(_side_group_ops, world, (layout,), timeout_s=600)
        for rank, r in enumerate(ranks):
            assert r["sum"] == world * (world - 1) // 2  # a world reduction over three small groups
            assert r["ring"] == [((rank - 1) % world, (rank - 1) % world + 1)]  # routed to rank+1
        ops = {r["checkpoint"] for r in ranks} | {r["replica"] for r in ranks}
        assert len(ops) == 1, ranks  # every rank pays the same, for both
        per_group[world] = (ops.pop() / dims, max(r["world"] for r in ranks))
    assert per_group[4][0] == per_group[8][0], per_group  # a 2-rank group costs the same at 4 and 8
    assert per_group[8][1] > per_group[4][1] > per_group[4][0], per_group  # a world group grows
