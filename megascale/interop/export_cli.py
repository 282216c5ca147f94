"""`megascale export CHECKPOINT --out DIR`: a checkpoint as a Hugging Face model directory."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from megascale.checkpoint.storage import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="a checkpoint directory (step_N), a checkpoint root or a run "
        "directory (train.run_dir) whose newest valid checkpoint is exported; local path or fsspec URL",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: as saved)")
    parser.add_argument(
        "--tokenizer",
        help="tokenizer.json or 'bytes' to ship (default: the run's, "
        "from data.tokenizer or the prepared data's manifest)",
    )
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (GiB)")


def run(args: argparse.Namespace) -> int:
    from megascale.data.shards import DataError
    from megascale.interop.export import export
    from megascale.interop.pretrained import MEGASCALE_TYPE

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        done = export(
            args.checkpoint, Path(args.out), DTYPES.get(args.dtype), args.tokenizer, int(args.max_shard_gb * (1 << 30))
        )
    except (CheckpointError, DataError, FileNotFoundError) as exc:
        print(f"megascale export: {exc}", file=sys.stderr)
        return 1
    how = (
        "AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) (no standard architecture "
        "computes this model: remote code written beside it)"
        if done.model_type == MEGASCALE_TYPE
        else "AutoModelForCausalLM.from_pretrained(dir)"
    )
    print(
        f"wrote step {done.step} to {done.out} as {done.model_type} ({len(done.files)} safetensors file(s), "
        f"tokenizer from {done.tokenizer}); load it with {how}"
    )
    return 0
