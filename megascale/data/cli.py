"""`megascale prep`: text / JSONL / Parquet into token shards with a manifest.

Examples:
    megascale prep docs/ --out data/docs-bytes
    megascale prep corpus.jsonl --field content --tokenizer tokenizer.json --out data/c --workers 4
    megascale prep corpus.parquet --train-tokenizer 8192 --out data/c-bpe8k
"""

from __future__ import annotations

import argparse
import sys

from megascale.data.prep import Options, prepare
from megascale.data.shards import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="files or directories (searched recursively)")
    parser.add_argument("--out", required=True, help="output token directory")
    parser.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"],
                        help="input format (auto: by suffix; a text file is one document)")
    parser.add_argument("--field", default="text", help="JSONL key / Parquet column of the text")
    parser.add_argument("--tokenizer", default="bytes",
                        help="'bytes' (built in, vocabulary 257) or a Hugging Face tokenizer.json")
    parser.add_argument("--train-tokenizer", type=int, default=0, metavar="VOCAB",
                        help="train a byte-level BPE of this size on the inputs and use it")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes")
    parser.add_argument("--shard-tokens", type=int, default=1 << 26,
                        help="tokens per shard (shards end at document boundaries)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.overrides:
        print(f"megascale prep: takes no config overrides, got {args.overrides}", file=sys.stderr)
        return 2
    if args.train_tokenizer and args.tokenizer != "bytes":
        print("megascale prep: pass --tokenizer or --train-tokenizer, not both", file=sys.stderr)
        return 2
    if args.workers < 1 or args.shard_tokens < 1:
        print("megascale prep: --workers and --shard-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        manifest = prepare(args.inputs, args.out, args.tokenizer,
                           options=Options(args.format, args.field), workers=args.workers,
                           train_vocab=args.train_tokenizer, shard_tokens=args.shard_tokens,
                           overwrite=args.overwrite, progress=not args.quiet)
    except (DataError, FileNotFoundError) as exc:
        print(f"megascale prep: error: {exc}", file=sys.stderr)
        return 1
    tok = manifest["tokenizer"]
    print(f"wrote {args.out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
          f"in {len(manifest['shards'])} shard(s) of {manifest['dtype']}, tokenizer "
          f"{tok['name']} (vocabulary {tok['vocab_size']}); train with "
          f"--data.path={args.out} --model.vocab_size={tok['vocab_size']}")
    return 0
