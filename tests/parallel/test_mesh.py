"""ParallelMesh on real gloo processes: coordinates, groups, errors, single-process mode."""

import pytest
import torch
import torch.distributed as dist

from megascale.config import ConfigError, ParallelConfig
from megascale.layout.grid import DIMS
from megascale.parallel import init_mesh
from megascale.testing.launch import run_local

pytestmark = pytest.mark.timeout(600)  # generous: the deadlines below catch hangs


def _probe(pp: int, dp: int, tp: int) -> dict:
    """Each rank reports what its mesh says and what all_reduce inside each group sees."""
    mesh = init_mesh(ParallelConfig(pp=pp, dp=dp, tp=tp), device="cpu")
    try:
        out = {
            "rank": mesh.rank,
            "coords": (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank),
            "sizes": (mesh.pp_size, mesh.dp_size, mesh.tp_size),
            "first_last": (mesh.is_first_stage, mesh.is_last_stage),
            "backend": mesh.backend,
            "barriers": mesh.startup.barriers,
            "group_ops": mesh.startup.group_ops,
            "none": [d for d in DIMS if getattr(mesh, f"{d}_group") is None],
            "ranks": {d: mesh.grid.group_of(mesh.rank, d) for d in DIMS},
            "reduced": {},
        }
        for dim in DIMS:
            group = getattr(mesh, f"{dim}_group")
            if group is None:
                continue
            # sum of ranks and member count, seen through the real group
            t = torch.tensor([float(mesh.rank), 1.0])
            dist.all_reduce(t, group=group)
            out["reduced"][dim] = (int(t[0]), int(t[1]), dist.get_world_size(group))
        out["ckpt"] = {}
        for dim, group in mesh.checkpoint_groups.items():  # gloo twins of the grid's groups
            if group is not None:
                out["ckpt"][dim] = (dist.get_process_group_ranks(group), dist.get_backend(group))
        return out
    finally:
        mesh.destroy()


def _check(results: list[dict], pp: int, dp: int, tp: int) -> None:
    world = pp * dp * tp
    assert [r["rank"] for r in results] == list(range(world))
    for r in results:
        p, d, t = r["coords"]
        assert r["rank"] == (p * dp + d) * tp + t
        assert r["sizes"] == (pp, dp, tp)
        assert r["first_last"] == (p == 0, p == pp - 1)
        assert r["backend"] == "gloo"
        assert r["barriers"] == 0  # no global barrier behind any group
        assert r["ckpt"] == {d: (m, "gloo") for d, m in r["ranks"].items() if len(m) > 1}
        for dim in DIMS:
            members = r["ranks"][dim]
            assert r["rank"] in members
            if len(members) == 1:
                assert dim in r["none"]
            else:
                assert r["reduced"][dim] == (sum(members), len(members), len(members)), dim


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 1, 2)])
def test_mesh_four_ranks(layout):
    _check(run_local(_probe, 4, layout, timeout_s=300), *layout)


@pytest.mark.slow
def test_mesh_eight_ranks():
    _check(run_local(_probe, 8, (2, 2, 2), timeout_s=400), 2, 2, 2)


def _mismatch() -> str:
    try:
        init_mesh(ParallelConfig(pp=1, dp=2, tp=2), device="cpu")
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_world_size_mismatch_is_a_config_error_before_any_collective():
    # Two ranks launched for a 4-rank layout: both must fail fast, not hang in rendezvous.
    messages = run_local(_mismatch, 2, timeout_s=180)
    for msg in messages:
        assert "parallel.dp*cp*tp*pp = 2*1*2*1 = 4 but WORLD_SIZE=2" in msg


def test_single_process_needs_no_rendezvous(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    mesh = init_mesh(ParallelConfig(), device="cpu")
    assert not dist.is_initialized()
    assert (mesh.rank, mesh.world_size, tuple(mesh.coords)) == (0, 1, (0, 0, 0, 0))
    assert all(getattr(mesh, f"{d}_group") is None for d in DIMS)
    assert mesh.checkpoint_groups == {d: None for d in DIMS} and mesh.replica_groups == mesh.checkpoint_groups
    assert mesh.is_first_stage and mesh.is_last_stage
    assert mesh.device == torch.device("cpu") and mesh.backend == "gloo"
    mesh.destroy()


def test_single_process_layout_mismatch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"= 2 but WORLD_SIZE=1"):
        init_mesh(ParallelConfig(dp=2), device="cpu")
