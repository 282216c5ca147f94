"""Whole tensors out of a checkpoint: what `megascale export` (megascale.interop) writes out."""

from __future__ import annotations

import logging

import torch

from megascale.checkpoint.catalog import candidates
from megascale.checkpoint.comm import Comm
from megascale.checkpoint.manifest import RNG
from megascale.checkpoint.restore import load
from megascale.checkpoint.state import VALUE, Target, torch_dtype
from megascale.checkpoint.storage import CheckpointError, open_root
from megascale.layout.shard import ShardSpec

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
            targets = [
                Target(param, fld, ShardSpec(tuple(shape)), torch.empty(shape, dtype=torch_dtype(dtype)))
                for (param, fld), (shape, dtype) in sorted(shapes.items())
            ]
            load(fs, candidate, manifest, Comm.local(), lambda _fields, targets=targets: targets)
            return {(t.param, t.field): t.tensor for t in targets}, manifest
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", candidate, exc)
    raise CheckpointError(f"no valid checkpoint at {url}")
