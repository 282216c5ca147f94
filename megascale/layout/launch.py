"""Where this process sits in the launch, read once from the torchrun-style environment.

A launcher (torchrun, `megascale train --nproc`, an executor) gives each rank RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK. They are read here, once per process, and the mesh carries the
result (`mesh.launch`), so the trainer, the mesh and the checkpointer cannot read them
differently -- above all, they cannot pick different devices.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megascale.config.fields import ConfigError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int | None = None  # None: no per-node launcher said how many ranks a node has
    launched: bool = False  # a launcher started this process (RANK is set)
    node: int | None = None  # GROUP_RANK: this node's index among the job's nodes, if the launcher said

    def node_ranks(self) -> list[int] | None:
        """This node's ranks (contiguous per node, as torchrun numbers them), if a launcher said
        how many a node has."""
        if self.local_world_size is None:
            return None
        size = self.local_world_size
        node = self.node if self.node is not None else self.rank // size
        return list(range(node * size, min((node + 1) * size, self.world_size)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ
        rank, world = _integer(env, "RANK", 0), _integer(env, "WORLD_SIZE", 1)
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is out of range for WORLD_SIZE={world}")
        local_world = _integer(env, "LOCAL_WORLD_SIZE", 0) or None
        node = _integer(env, "GROUP_RANK", -1)
        return cls(
            rank=rank,
            world_size=world,
            local_rank=_integer(env, "LOCAL_RANK", rank),
            local_world_size=local_world,
            launched="RANK" in env,
            node=None if node < 0 else node,
        )

    def device(self, choice: str) -> torch.device:
        """The device `train.device` (auto, cpu or cuda) means for this rank: its node's GPU
        LOCAL_RANK, modulo the GPUs it sees (an executor may show each rank only its own)."""
        if choice not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device must be 'auto', 'cpu' or 'cuda', got {choice!r}")
        if choice == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device='cuda' but CUDA is not available; use train.device='cpu' or 'auto'")
        if choice == "cpu" or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", self.local_rank % torch.cuda.device_count())


def _integer(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} must be an integer (set by the launcher)") from None
