"""Placement keeps tp inside nodes and dp groups under few ToRs; ECMP collides less with it."""

from __future__ import annotations

import random

import pytest

from megascale.config import ConfigError
from megascale.layout.grid import RankGrid
from megascale.plan import ecmp
from megascale.plan.env import collective_timeout_s, communication_env, rdma_ride_out_s
from megascale.plan.layout import Layout
from megascale.plan.placement import (
    Host,
    describe,
    mesh_groups,
    place,
    read_hosts,
    scheduler_order,
    synthetic_hosts,
)

LAYOUTS = [
    Layout(dp=16, tp=8, pp=4),
    Layout(dp=32, tp=4, pp=2, v=2),
    Layout(dp=8, tp=2, pp=8),
    Layout(dp=64, tp=1, pp=1),
    Layout(dp=3, tp=8, pp=2),
]


def ragged_hosts(nodes: int, seed: int) -> list[Host]:
    """Hosts under ToRs of uneven size (failed nodes, a busy scheduler), in random order."""
    rng = random.Random(seed)
    hosts, tor = [], 0
    while len(hosts) < nodes + 5:
        for _ in range(rng.randint(1, 8)):
            hosts.append(Host(f"h{len(hosts)}", tor, tor // 4))
        tor += 1
    rng.shuffle(hosts)
    return hosts


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.label)
def test_tp_groups_never_cross_nodes(flat8, layout):
    nodes = layout.world // 8
    for hosts in (synthetic_hosts(flat8, nodes), ragged_hosts(nodes, seed=nodes)):
        for placement in (place(layout, hosts, 8), scheduler_order(layout, hosts, 8)):
            for group in mesh_groups(layout)["tp"]:
                assert len({placement.host_of(r).name for r in group}) == 1
            assert len(set(placement.rank_order())) == nodes  # each host used once


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.label)
def test_placement_keeps_dp_groups_under_few_tors(flat8, layout):
    nodes = layout.world // 8
    hosts = ragged_hosts(nodes, seed=1)
    placed, naive = describe(place(layout, hosts, 8)), describe(scheduler_order(layout, hosts, 8))
    assert placed["dp_group_tors_mean"] <= naive["dp_group_tors_mean"]
    on_grid = describe(place(layout, synthetic_hosts(flat8, nodes), 8))
    stage_nodes = max(1, layout.dp * layout.tp // 8)
    assert on_grid["dp_group_tors_max"] == -(-stage_nodes // 8)  # the fewest ToRs possible


def test_mesh_groups_partition_ranks():
    layout = Layout(dp=2, tp=2, pp=2)
    groups = mesh_groups(layout)
    for kind in ("tp", "dp", "pp"):
        ranks = sorted(r for g in groups[kind] for r in g)
        assert ranks == list(range(8))
    assert [0, 1] in groups["tp"] and [0, 2] in groups["dp"] and [0, 4] in groups["pp"]


def test_ecmp_fewer_collisions_with_placement(flat8):
    layout = Layout(dp=64, tp=8, pp=4)  # 2048 GPUs: each stage's 64 nodes span 8 ToRs
    hosts = synthetic_hosts(flat8, layout.world // 8)
    placed = place(layout, hosts, 8)
    naive = scheduler_order(layout, hosts, 8, seed=3)
    split = ecmp.Fabric.of(flat8, split=True)
    good, bad = ecmp.simulate(placed, split, trials=5), ecmp.simulate(naive, split, trials=5)
    assert good.cross_tor_flows < bad.cross_tor_flows / 4
    assert good.collided_flows < bad.collided_flows
    assert good.slowdown < bad.slowdown
    unsplit = ecmp.simulate(naive, ecmp.Fabric.of(flat8, split=False), trials=5)
    assert bad.slowdown < unsplit.slowdown  # 2x200G split downlinks collide less


def test_ecmp_no_network_no_slowdown(a100):
    layout = Layout(dp=8, tp=1, pp=1)  # one node
    res = ecmp.simulate(place(layout, synthetic_hosts(a100, 1), 8), ecmp.Fabric.of(a100))
    assert (res.slowdown, res.network_flows) == (1.0, 0)


def test_read_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# name tor pod\nn1 0 0\nn2 0\nn3 1 0  # spare\n")
    assert [h.name for h in read_hosts(path)] == ["n1", "n2", "n3"]
    path.write_text("n1\n")
    with pytest.raises(ConfigError, match="name tor"):
        read_hosts(path)
    with pytest.raises(ConfigError, match="tp=3"):
        place(Layout(dp=1, tp=3), [Host("a", 0, 0)], 8)


def test_communication_env_rides_out_flaps():
    env = {s.name: s for s in communication_env(step_time_s=40.0)}
    assert int(env["NCCL_IB_RETRY_CNT"].value) == 7
    assert "TORCH_FR_BUFFER_SIZE" in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" in env
    timeout = float(env["MEGASCALE_COLLECTIVE_TIMEOUT_S"].value)
    assert timeout >= 2 * rdma_ride_out_s() and timeout >= 20 * 40
    assert float(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"].value) > timeout
    assert collective_timeout_s(None) == 600
    assert all(s.why for s in env.values())


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.label)
def test_mesh_groups_are_the_rank_grids(layout):
    """The planner places the groups the mesh creates: one rank order (layout/grid.py)."""
    grid = RankGrid.of(layout)
    assert layout.world == grid.world_size
    assert mesh_groups(layout) == {dim: grid.groups(dim) for dim in ("tp", "dp", "pp")}
