"""A Hugging Face checkpoint directory on disk: its config.json and its safetensors, read lazily.

A model's weights are never loaded whole: `HFDirectory.tensor(name)` opens the file holding that
tensor (one file, or the shards listed in `model.safetensors.index.json`) with safetensors'
`safe_open` and reads just that tensor. Pickled weights (`pytorch_model.bin`) are refused, not
loaded: unpickling runs code from the file. Writing goes the other way, in shards of a bounded
size with the same index format, so what `megascale export` writes reads back here and in
`transformers`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class InteropError(ValueError):
    """A checkpoint directory or its config that megascale cannot read or map. One line, naming it."""


class HFDirectory:
    """config.json and the tensors of a local transformers-style checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise InteropError(f"{self.path} is not a directory (pass a local Hugging Face checkpoint directory)")
        config = self.path / "config.json"
        if not config.is_file():
            raise InteropError(f"{self.path} has no config.json (pass a directory saved by save_pretrained)")
        try:
            self.config: dict = json.loads(config.read_text())
        except (OSError, ValueError) as exc:
            raise InteropError(f"{config} is not valid JSON: {exc}") from exc
        self._open: dict[Path, object] = {}

    @functools.cached_property
    def files(self) -> dict[str, Path]:
        """Where each stored tensor is (read on first use: a config can be refused before)."""
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise InteropError(f"{index} is not a safetensors index (no weight_map): {exc}") from exc
            files = {name: self.path / file for name, file in weight_map.items()}
            missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
            if missing:
                raise InteropError(f"{index} lists shards that are not in {self.path}: {', '.join(missing[:3])}")
            return files
        single = self.path / SINGLE
        if single.is_file():
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), single)
        pickled = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt")]
        if pickled:
            raise InteropError(
                f"{self.path} holds only pickled weights ({pickled[0]}); megascale never unpickles a "
                "checkpoint (it can run code): save it as safetensors (save_pretrained(..., "
                "safe_serialization=True)) and import that"
            )
        raise InteropError(f"{self.path} has no {SINGLE} nor {INDEX}")

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def resolve(self, name: str, prefix: str) -> str | None:
        """`name` as stored: with the model class's prefix (`model.`, `transformer.`) or, as a base
        model saves it, without."""
        if name in self.files:
            return name
        if name.startswith(prefix) and name[len(prefix) :] in self.files:
            return name[len(prefix) :]
        return None

    def _handle(self, file: Path):
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(self.files[name]).get_tensor(name)


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int, metadata: dict[str, str]
) -> list[Path]:
    """Write `tensors` as one `model.safetensors`, or as shards of at most `max_shard_bytes`
    (a tensor larger than that gets a shard of its own) with `model.safetensors.index.json`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata=metadata)
        return [out / SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return [out / n for n in names]
