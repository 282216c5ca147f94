"""`megascale export CHECKPOINT --out DIR`: a checkpoint as safetensors + config.json."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from megascale.checkpoint.storage import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory (step_N), or a checkpoint "
                        "root whose newest valid checkpoint is exported; local path or fsspec URL")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: as saved)")


def run(args: argparse.Namespace) -> int:
    from megascale.checkpoint.export import export

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        out = export(args.checkpoint, Path(args.out), DTYPES.get(args.dtype))
    except CheckpointError as exc:
        print(f"megascale export: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}")
    return 0
