"""Initial parameter values as a function of (seed, parameter name), independent of everything else.

A rank that holds one pipeline stage and one tensor-parallel slice of a 175B model cannot build
the whole model to cut its part out of it. With each parameter's value depending only on the
seed and its single-process name, the rank builds its part on the meta device and computes only
the parameters it holds (`megascale.parallel.materialize`), getting exactly the values the
single-process model has. Values come from a CPU generator, so they are the same on every rank
whatever its accelerator.

GPT-2 rules: biases 0, LayerNorm weights 1, residual output projections N(0, std/sqrt(2L)),
every other matrix N(0, std).
"""

from __future__ import annotations

import math
import zlib

import torch

from megascale.config.schema import ModelConfig


def initial_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The fp32 CPU tensor parameter `name` (its single-process name) starts from."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1:  # LayerNorm weight
        return torch.ones(shape)
    std = cfg.init_std / math.sqrt(2 * cfg.layers) if name.endswith("proj.weight") else cfg.init_std
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed of its own for each parameter (the name's CRC-32 mixed into the job's seed)."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)
