"""RankGrid: the layout arithmetic every group comes from (no processes)."""

import itertools

import pytest

from megascale.layout.grid import DIMS, Coords, RankGrid

LAYOUTS = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1), (2, 2, 2), (3, 2, 4), (4, 1, 1)]


@pytest.mark.parametrize("pp,dp,tp", LAYOUTS)
def test_coords_round_trip_and_tp_innermost(pp, dp, tp):
    grid = RankGrid(pp=pp, dp=dp, tp=tp)
    assert grid.world_size == pp * dp * tp
    seen = []
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        assert grid.rank_of(*c) == rank
        seen.append(c)
    # arange(world).view(pp, dp, tp): enumerating coordinates in C order gives ranks in order
    assert seen == [Coords(*c) for c in itertools.product(range(pp), range(dp), range(tp))]


@pytest.mark.parametrize("pp,dp,tp", LAYOUTS)
@pytest.mark.parametrize("dim", DIMS)
def test_groups_partition_world_and_match_group_of(pp, dp, tp, dim):
    grid = RankGrid(pp=pp, dp=dp, tp=tp)
    groups = grid.groups(dim)
    assert sorted(r for g in groups for r in g) == list(range(grid.world_size))
    assert all(len(g) == grid.group_size(dim) for g in groups)
    for g in groups:
        for rank in g:
            assert grid.group_of(rank, dim) == g


def test_group_semantics_on_2x2x2():
    grid = RankGrid(pp=2, dp=2, tp=2)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="unknown mesh dimension 'mp'"):
        grid.groups("mp")


@pytest.mark.parametrize("pp,dp,tp", LAYOUTS)
def test_fixed_axes_inside_groups(pp, dp, tp):
    grid = RankGrid(pp=pp, dp=dp, tp=tp)
    fixed = {
        "tp": ("pp", "dp"),
        "dp": ("pp", "tp"),
        "pp": ("dp", "tp"),
    }
    for dim, axes in fixed.items():
        for g in grid.groups(dim):
            coords = [grid.coords(r) for r in g]
            for axis in axes:
                assert len({getattr(c, axis) for c in coords}) == 1, (dim, axis, g)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="RankGrid.tp"):
        RankGrid(pp=1, dp=1, tp=0)
    grid = RankGrid(pp=1, dp=2, tp=2)
    with pytest.raises(ValueError, match="rank 4 out of range"):
        grid.coords(4)
    with pytest.raises(ValueError, match="dp coordinate 2"):
        grid.rank_of(0, 2, 0)
    with pytest.raises(ValueError, match="unknown mesh dimension 'ep'"):
        grid.groups("ep")


def test_cp_sits_between_tp_and_dp():
    """arange(world).view(pp, dp, cp, tp): tp neighbours first, then the cp ring, then dp."""
    grid = RankGrid(pp=2, dp=2, tp=2, cp=3)
    assert grid.world_size == 24
    seen = [grid.coords(r) for r in range(24)]
    assert seen == [
        Coords(pp=p, dp=d, tp=t, cp=c) for p, d, c, t in itertools.product(range(2), range(2), range(3), range(2))
    ]
    assert all(grid.rank_of(**c._asdict()) == r for r, c in enumerate(seen))
    assert grid.group_of(0, "cp") == [0, 2, 4] and grid.group_of(0, "dp") == [0, 6]
    assert RankGrid.of(type("Layout", (), {"pp": 1, "dp": 2, "tp": 1})()).cp == 1  # degrees without cp
