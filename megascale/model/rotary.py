"""Rotary position embeddings (Su et al. 2021), rotating halves of each head's dimensions.

Optionally only the first `rotary_dim` dimensions of a head rotate (GPT-NeoX), and the
frequencies may be rescaled as Llama 3.1 does for long contexts (`RopeScaling`).
"""

from __future__ import annotations

import math

import torch

from megascale.config.schema import RopeScaling
from megascale.model.eager_cache import eager_cache

# (kind, factor, low_freq_factor, high_freq_factor, original_max_positions): hashable for the cache
ScalingKey = tuple[str, float, float, float, int]


def scaling_key(scaling: RopeScaling) -> ScalingKey:
    return (
        scaling.kind,
        scaling.factor,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
        scaling.original_max_positions,
    )


def inverse_frequencies(rotary_dim: int, base: float, scaling: ScalingKey) -> torch.Tensor:
    """fp64 [rotary_dim / 2]; Llama 3 divides low frequencies by `factor` and blends the band
    between `original / low_freq_factor` and `original / high_freq_factor` wavelengths."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind, factor, low, high, original = scaling
    if kind == "none":
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(band, blended, scaled)


@eager_cache(maxsize=8)
def rotary_tables(
    seq_len: int, rotary_dim: int, base: float, scaling: ScalingKey, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq, rotary_dim] (cached per shape in eager runs: they never change)."""
    inv_freq = inverse_frequencies(rotary_dim, base, scaling).to(device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., seq, head_dim]; its first cos.shape[-1] dimensions rotate, the rest pass."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
