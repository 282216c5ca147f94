"""Whole tensors out of a checkpoint, and `megascale export`: safetensors + config.json.

The export loads into a single-process `GPT` with `load_exported`, with no pickle anywhere:
tensors through safetensors, the model config as JSON.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megascale.checkpoint.catalog import candidates
from megascale.checkpoint.comm import Comm
from megascale.checkpoint.manifest import RNG
from megascale.checkpoint.restore import restore
from megascale.checkpoint.state import VALUE, Target, torch_dtype
from megascale.checkpoint.storage import CheckpointError, open_root
from megascale.config import ModelConfig
from megascale.layout.shard import ShardSpec
from megascale.model import GPT

log = logging.getLogger("megascale.checkpoint")


def whole_tensors(url: str, fields: tuple[str, ...] = (VALUE,)):
    """{(parameter, field): whole tensor} and the manifest of the checkpoint at `url` (a
    checkpoint directory, or a root whose newest valid checkpoint is used). Reads every
    stored byte once and checks every checksum."""
    fs, path = open_root(url)
    for candidate, manifest in candidates(fs, path):
        try:
            shapes: dict[tuple[str, str], tuple[list[int], str]] = {}
            for rec in manifest["tensors"]:
                if not rec["param"].startswith(RNG) and rec["field"] in fields:
                    shapes[(rec["param"], rec["field"])] = (rec["spec"]["global_shape"], rec["dtype"])
            targets = [Target(param, fld, ShardSpec(tuple(shape)),
                              torch.empty(shape, dtype=torch_dtype(dtype)))
                       for (param, fld), (shape, dtype) in sorted(shapes.items())]
            restore(fs, candidate, manifest, targets, Comm(None, 0, 1))
            return {(t.param, t.field): t.tensor for t in targets}, manifest
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", candidate, exc)
    raise CheckpointError(f"no valid checkpoint at {url}")


def export(url: str, out: Path, dtype: torch.dtype | None = None) -> Path:
    tensors, manifest = whole_tensors(url)
    out.mkdir(parents=True, exist_ok=True)
    weights = {param: (t.to(dtype) if dtype else t).contiguous() for (param, _), t in tensors.items()}
    save_file(weights, str(out / "model.safetensors"),
              metadata={"format": "pt", "step": str(manifest["step"])})
    (out / "config.json").write_text(json.dumps(
        {"model": manifest["config"]["model"], "step": manifest["step"]}, indent=1))
    return out


def load_exported(out: Path) -> GPT:
    """A single-process GPT with the exported weights (tied weights may be stored once)."""
    config = json.loads((Path(out) / "config.json").read_text())
    model = GPT(ModelConfig(**config["model"]))
    weights = load_file(str(Path(out) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    loaded_ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in weights}
    really_missing = [n for n in missing if id(model.get_parameter(n)) not in loaded_ids]
    if really_missing or unexpected:
        raise CheckpointError(f"export does not fit the model: missing {really_missing}, "
                              f"unexpected {unexpected}")
    return model
