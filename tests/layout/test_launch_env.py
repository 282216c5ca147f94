"""The launcher's environment is read in one place, and the device follows from it once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megascale.config import ConfigError
from megascale.layout.launch import LaunchEnv

PACKAGE = Path(__file__).resolve().parents[2] / "megascale"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def test_from_env_reads_the_launcher_once():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert LaunchEnv.from_env(env) == LaunchEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, launched=True)
    alone = LaunchEnv.from_env({})
    assert (alone.rank, alone.world_size, alone.local_world_size, alone.launched) == (0, 1, None, False)
    assert LaunchEnv.from_env({"RANK": "3", "WORLD_SIZE": "4"}).local_rank == 3  # no LOCAL_RANK: the rank


def test_node_ranks_follow_group_rank_or_the_rank():
    assert LaunchEnv(rank=5, world_size=8, local_world_size=4, node=1).node_ranks() == [4, 5, 6, 7]
    assert LaunchEnv(rank=5, world_size=6, local_world_size=4).node_ranks() == [4, 5]  # a short last node
    assert LaunchEnv(rank=1, world_size=8, local_world_size=4, node=1).node_ranks() == [4, 5, 6, 7]
    assert LaunchEnv(rank=5, world_size=8).node_ranks() is None  # no launcher said what a node holds
    assert LaunchEnv.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}).node == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"RANK=4 is out of range for WORLD_SIZE=4"),
        ({"LOCAL_RANK": "one"}, r"\$LOCAL_RANK='one' must be an integer"),
    ],
)
def test_bad_launch_environment_names_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        LaunchEnv.from_env(env)


def test_device_choice():
    launch = LaunchEnv(local_rank=3)
    assert launch.device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="train.device must be"):
        launch.device("tpu")
    if torch.cuda.is_available():
        assert launch.device("cuda") == torch.device("cuda", 3 % torch.cuda.device_count())
    else:
        assert launch.device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match="train.device='cuda' but CUDA is not available"):
            launch.device("cuda")


def test_the_mesh_carries_the_launch_and_its_device(monkeypatch):
    from megascale.config.schema import ParallelConfig
    from megascale.parallel.mesh import init_mesh

    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    mesh = init_mesh(ParallelConfig(), device="auto")
    assert mesh.launch == LaunchEnv.from_env() and mesh.launch.local_world_size == 1
    assert mesh.device == mesh.launch.device("auto")
    mesh.destroy()


def test_no_other_module_reads_the_launch_variables():
    names = "|".join(LAUNCH_VARS)
    pattern = re.compile(rf"environ(?:\.get\(|\[)\s*[\"']({names})[\"']")
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text()))
    assert not readers, f"read the launch through LaunchEnv (mesh.launch): {readers}"
