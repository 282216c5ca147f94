"""`megascale generate CKPT --prompt TEXT`: what a model writes, greedy or sampled."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="a megascale checkpoint (step_N or a checkpoint root) or a Hugging "
        "Face model directory (an export, or any checkpoint `megascale import` reads)",
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tokenizer", help="tokenizer.json or 'bytes' (default: the run's / the directory's)")
    parser.add_argument("--ids", action="store_true", help="also print the generated token ids")


def run(args: argparse.Namespace) -> int:
    from megascale.checkpoint.storage import CheckpointError
    from megascale.data.shards import DataError
    from megascale.interop.generate import encode_prompt, generate, load
    from megascale.interop.hf_files import InteropError

    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        print("megascale generate: --max-new-tokens must be >= 1, --temperature and --top-k >= 0", file=sys.stderr)
        return 2
    try:
        loaded = load(args.checkpoint, args.tokenizer)
    except (CheckpointError, DataError, InteropError, FileNotFoundError) as exc:
        print(f"megascale generate: {exc}", file=sys.stderr)
        return 1
    prompt = encode_prompt(loaded.tokenizer, args.prompt)
    if not prompt:
        print("megascale generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    new = generate(
        loaded.model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, stop=loaded.tokenizer.eod
    )
    print(f"[{loaded.source}]", file=sys.stderr)
    sys.stdout.write(args.prompt + loaded.tokenizer.decode(new).decode("utf-8", errors="replace") + "\n")
    if args.ids:
        print(" ".join(map(str, new)))
    return 0
