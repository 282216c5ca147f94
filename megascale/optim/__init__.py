"""Optimizers (shard-aware LAMB, AdamW), the learning-rate schedule and gradient clipping."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megascale.config import ConfigError
from megascale.config.schema import OptimConfig
from megascale.layout.shard import shard_spec
from megascale.optim.lamb import Lamb
from megascale.optim.norms import SumOver, all_reduce, clip_grad_norm_, clip_to_norm_, global_grad_norm, whole_sq_norms
from megascale.optim.schedule import lr_at


def decays(name: str, tensor: torch.Tensor) -> bool:
    """Weight decay applies to matrices (GEMM weights, embeddings), not to biases and norms;
    a flat ZeRO shard of a matrix is a matrix (its spec keeps the whole parameter's shape)."""
    return shard_spec(tensor).matrix and not name.endswith("bias")


def build_optimizer(
    named: Iterable[tuple[str, torch.Tensor]], cfg: OptimConfig, sum_over: SumOver = all_reduce
) -> torch.optim.Optimizer:
    """`named` pairs a parameter's name with the tensor to optimise: the parameter itself, or
    this rank's shard of it under ZeRO. `sum_over`: LAMB's collective for sharded norms."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for name, tensor in named:
        if tensor.dtype != torch.float32 and tensor.dtype != torch.float64:
            raise ConfigError(
                f"optim.name={cfg.name!r} would step on {name} in {tensor.dtype} and keep its state in it: "
                "the optimizer needs fp32 master weights (train.param_dtype=bf16 keeps them in the ZeRO "
                "shards; an optimizer given the bf16 parameters themselves cannot)"
            )
        (decay if decays(name, tensor) else no_decay).append(tensor)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, sum_over=sum_over)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, foreach=False)


__all__ = [
    "Lamb",
    "build_optimizer",
    "clip_grad_norm_",
    "clip_to_norm_",
    "decays",
    "global_grad_norm",
    "lr_at",
    "whole_sq_norms",
]
