"""What a rank saves and where a loaded value goes: the bridge between a `CheckpointState` and records.

Shared state is a list of `Piece`s: one field ("value" or "optim.<key>") of one parameter, as
the local tensor holding it with its `ShardSpec`, so any layout can load it. Optimizer state
is keyed by parameter name (the optimizer's tensors are `runner.optimizer_tensors()`); its
scalars ("step") are kept as JSON. RNG states become integer arrays plus JSON, so loading
never unpickles anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megascale.checkpoint.manifest import DTYPE_SIZES, RNG
from megascale.checkpoint.stateful import CheckpointState
from megascale.layout.shard import ShardSpec, shard_spec

VALUE = "value"
OPTIM = "optim."
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES}


@dataclass
class Piece:
    param: str  # parameter name, or "__rng__/<rank>" for a rank's RNG arrays
    field: str
    spec: ShardSpec | None  # None: rank-local (RNG)
    tensor: torch.Tensor

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.param, self.field, spec_key(self.spec))


def torch_dtype(name: str) -> torch.dtype:
    """The dtype of a manifest's dtype name (the manifest schema admits only these names)."""
    return TORCH_DTYPES[name]


def spec_key(spec: ShardSpec | None) -> str:
    return "" if spec is None else json.dumps(spec.to_json())


# ------------------------------------------------------------------------------ save side
def shared_pieces(state: CheckpointState) -> tuple[list[Piece], dict[str, dict[str, Any]]]:
    """The tensors the optimizer steps on and their optimizer state, plus JSON scalars."""
    optimizer = state.optimizer
    pieces: list[Piece] = []
    plain: dict[str, dict[str, Any]] = {}
    for name, tensor in state.model.optimizer_tensors():
        spec = shard_spec(tensor)
        pieces.append(Piece(name, VALUE, spec, tensor.detach()))
        for key, value in sorted(optimizer.state.get(tensor, {}).items()):
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == tensor.shape:
                pieces.append(Piece(name, OPTIM + key, spec, value))
            else:
                plain.setdefault(name, {})[key] = scalar_to_json(value, key)
    return pieces, plain


def record_of(piece: Piece, offset: int) -> dict[str, Any]:
    """A piece's record in a rank's data file (the manifest's `tensors` entries, less the file)."""
    return {
        "param": piece.param,
        "field": piece.field,
        "spec": piece.spec.to_json() if piece.spec else None,
        "dtype": str(piece.tensor.dtype).removeprefix("torch."),
        "shape": list(piece.tensor.shape),
        "offset": offset,
        "nbytes": piece.tensor.numel() * piece.tensor.element_size(),
    }


def scalar_to_json(value: Any, key: str) -> dict[str, Any]:
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise TypeError(
                f"optimizer state {key!r} is a tensor of shape {tuple(value.shape)} "
                "that is neither a scalar nor shaped like its parameter"
            )
        return {"kind": "tensor", "dtype": str(value.dtype).removeprefix("torch."), "value": value.item()}
    if isinstance(value, bool | int | float):
        return {"kind": type(value).__name__, "value": value}
    raise TypeError(f"optimizer state {key!r} of type {type(value).__name__} cannot be saved")


def scalar_from_json(data: dict[str, Any]) -> Any:
    """Scalar tensors come back on the CPU, where PyTorch's optimizers keep their "step"."""
    if data["kind"] == "tensor":
        return torch.tensor(data["value"], dtype=torch_dtype(data["dtype"]))
    return {"bool": bool, "int": int, "float": float}[data["kind"]](data["value"])


def rng_pieces(rank: int, state: dict[str, Any]) -> tuple[list[Piece], dict[str, Any]]:
    """A rank's RNG states as integer tensors (pieces) and JSON (the scalars around them)."""
    param = f"{RNG}{rank}"
    pieces, meta = [], {}
    for name, value in sorted(state.items()):
        if name == "python":
            version, internal, gauss = value
            pieces.append(Piece(param, name, None, torch.tensor(internal, dtype=torch.int64)))
            meta[name] = {"version": version, "gauss_next": gauss}
        elif name == "numpy":
            kind, keys, pos, has_gauss, cached = value
            pieces.append(Piece(param, name, None, torch.from_numpy(keys.astype(np.int64))))
            meta[name] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        elif torch.is_tensor(value):
            pieces.append(Piece(param, name, None, value.cpu()))
            meta[name] = {}
        else:
            raise TypeError(f"RNG state {name!r} of type {type(value).__name__} cannot be saved")
    return pieces, meta


def rng_from_arrays(arrays: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `rng_pieces`: the dict `RNGState.load_state_dict` takes."""
    state: dict[str, Any] = {}
    for name, info in meta.items():
        array = arrays[name]
        if name == "python":
            state[name] = (info["version"], tuple(array.tolist()), info["gauss_next"])
        elif name == "numpy":
            state[name] = (
                info["kind"],
                array.numpy().astype(np.uint32),
                info["pos"],
                info["has_gauss"],
                info["cached_gaussian"],
            )
        else:
            state[name] = array
    return state


# ------------------------------------------------------------------------------ load side
@dataclass
class Target:
    """A tensor this rank fills from a checkpoint."""

    param: str
    field: str
    spec: ShardSpec | None
    tensor: torch.Tensor

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.param, self.field, spec_key(self.spec))


def load_targets(state: CheckpointState, saved_fields: dict[str, set[str]]) -> list[Target]:
    """Every tensor of this rank the checkpoint sets: the optimizer's tensors, their state
    (into fresh tensors, installed by `install_optimizer_state` once the load succeeded) and
    parameters that are not optimizer tensors themselves (whole parameters under ZeRO)."""
    targets: list[Target] = []
    stepped = set()
    for name, tensor in state.model.optimizer_tensors():
        spec = shard_spec(tensor)
        stepped.add(id(tensor))
        targets.append(Target(name, VALUE, spec, tensor.data))
        for field in sorted(saved_fields.get(name, set()) - {VALUE}):
            fresh = torch.zeros_like(tensor, memory_format=torch.preserve_format)
            targets.append(Target(name, field, spec, fresh))
    for name, param in state.model.named_parameters():
        if id(param) not in stepped:
            targets.append(Target(name, VALUE, shard_spec(param), param.data))
    return targets


def install_optimizer_state(state: CheckpointState, targets: list[Target], plain: dict[str, dict[str, Any]]) -> None:
    """Replace the optimizer's state by the loaded tensors and scalars."""
    by_name = dict(state.model.optimizer_tensors())
    optimizer_state = state.optimizer.state
    optimizer_state.clear()
    for target in targets:
        if target.field.startswith(OPTIM) and target.param in by_name:
            optimizer_state[by_name[target.param]][target.field.removeprefix(OPTIM)] = target.tensor
    for name, scalars in plain.items():
        if name in by_name:
            for key, data in scalars.items():
                optimizer_state[by_name[name]][key] = scalar_from_json(data)
