"""Give the parameters a rank holds their values, after the layout was applied on the meta device.

The trainer builds the model on the meta device (no memory), lets tensor parallelism and the
pipeline split cut it as usual (slices of meta tensors are meta tensors carrying their
`ShardSpec`), and only then computes values, for the parameters this rank kept, one at a time:
the whole parameter from a `ValueSource` by its single-process name (seeded initial values, or a
pretrained model's tensor read from disk), this rank's tensor-parallel slice of it, copied to the
device. Peak host memory is one whole parameter, not the model, and every rank holds exactly the
values the single-process model has, so layouts stay in parity.
"""

from __future__ import annotations

import torch
from torch import nn

from megascale.layout.shard import set_shard_spec, shard_spec, tp_slice
from megascale.model.init import ValueSource


def materialize(chunks: list[nn.Module], values: ValueSource, device: torch.device) -> int:
    """Replace every meta parameter under `chunks` by a real one on `device` (same dtype, same
    `ShardSpec`, tied parameters stay tied); returns how many were made. Others are left alone."""
    names: dict[int, str] = {}  # the single-process name (the first one, for a tied parameter)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            names.setdefault(id(p), name)
    made: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for module in chunk.modules():
            for key, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in made:
                    made[id(p)] = _real(p, names[id(p)], values, device)
                module._parameters[key] = made[id(p)]
    return len(made)


def _real(meta: nn.Parameter, name: str, values: ValueSource, device: torch.device) -> nn.Parameter:
    spec = shard_spec(meta)
    value = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    value.copy_(tp_slice(values(name, spec.global_shape), spec))
    real = nn.Parameter(value, requires_grad=meta.requires_grad)
    set_shard_spec(real, spec)
    return real
