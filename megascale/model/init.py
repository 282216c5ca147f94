"""Initial parameter values as a function of (seed, parameter name), independent of everything else.

A rank that holds one pipeline stage and one tensor-parallel slice of a 175B model cannot build
the whole model to cut its part out of it. With each parameter's value depending only on the
seed and its single-process name, the rank builds its part on the meta device and computes only
the parameters it holds (`megascale.parallel.materialize`), getting exactly the values the
single-process model has. Values come from a CPU generator, so they are the same on every rank
whatever its accelerator.

GPT-2 rules: biases 0, norm weights 1, residual output projections N(0, std/sqrt(2L)),
every other matrix N(0, std).

Where values come from is pluggable (`ValueSource`): these seeded values for a new model, or a
pretrained model's tensors read one at a time (`megascale.interop`), keyed the same way.
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

import torch
from torch.overrides import TorchFunctionMode

from megascale.config.schema import ModelConfig


class ValueSource(Protocol):
    """The whole value of a parameter, by its single-process name and shape (any float dtype, CPU)."""

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...


class SeededValues:
    """`initial_value` for one model config and seed: what a new model starts from."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return initial_value(name, shape, self.cfg, self.seed)


class TorchInitSkipped(TorchFunctionMode):
    """torch.nn.init's in-place functions do nothing while a model is built (`reset_parameters`
    sets every value afterwards): no compute spent on values thrown away, and on the meta device
    no import of torch._dynamo, which torch's meta random ops pull in (a meta build of the
    default model: 1.9 s -> 0.01 s for the planner's fake-mode memory and interop's parameter
    list; a trainer's optimizer imports it anyway). Other torch functions run as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):
            return args[0] if args else kwargs["tensor"]  # what the in-place function returns
        return func(*args, **(kwargs or {}))


def initial_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The fp32 CPU tensor parameter `name` (its single-process name) starts from."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1:  # norm weight
        return torch.ones(shape)
    std = cfg.init_std / math.sqrt(2 * cfg.layers) if name.endswith("proj.weight") else cfg.init_std
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed of its own for each parameter (the name's CRC-32 mixed into the job's seed)."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)
