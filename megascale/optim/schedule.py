"""Learning rate: linear warm-up, then cosine decay to `min_lr_ratio * lr`.

A pure function of the step, so it needs no state in checkpoints beyond the step itself."""

from __future__ import annotations

import math

from megascale.config.schema import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max((cfg.decay_steps or total_steps) - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
