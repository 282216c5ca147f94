"""The state a checkpoint holds, as the objects that own it (`Stateful`-style, as torchtitan hands
`states={...}` to its checkpointer): the trainer builds one `CheckpointState` and gives it to
`CheckpointManager`, which reads and writes these objects and nothing else of the trainer.

- `model`: the sharded model (the runner): `optimizer_tensors()` are the tensors the optimizer
  steps on, each carrying its `ShardSpec`; `named_parameters()` adds any parameter that is not
  one of them (whole parameters under ZeRO, rebuilt from the shards on load);
- `optimizer`: its per-tensor state, saved beside those tensors;
- `loader`, `train`, `rng`: `state_dict()` / `load_state_dict()` objects: the data position,
  the step (`TrainState`), this process's random generators (`RNGState`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardedModel(Protocol):
    def optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]: ...

    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]: ...


@dataclass
class TrainState:
    """Where training is: the number of steps done (the LR schedule is a function of it)."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class RNGState:
    """This process's random generators: Python's, NumPy's, torch's CPU one and the device's."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


@dataclass
class CheckpointState:
    model: ShardedModel
    optimizer: torch.optim.Optimizer
    loader: Stateful
    train: Stateful  # its state_dict holds "step"
    rng: Stateful

    @property
    def step(self) -> int:
        return int(self.train.state_dict()["step"])
