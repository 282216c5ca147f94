"""`megascale prep`: text / JSON lines / Parquet / Arrow into token shards with a manifest.

Examples:
    megascale prep docs/ --out data/docs-bytes
    megascale prep 'corpus/*.jsonl.zst' --field content --tokenizer tokenizer.json --out data/c --workers 8
    megascale prep corpus.parquet --train-tokenizer 8192 --out data/c-bpe8k
    megascale prep hf_dataset_dir/ --tokenizer tokenizer.json --on-error=skip --out data/hf
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures.process import BrokenProcessPool

from megascale.data.inputs import KINDS
from megascale.data.ledger import REJECTED, LostData
from megascale.data.prep import Options, prepare
from megascale.data.shards import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        help="files, directories (searched recursively), globs or fsspec URLs; .gz/.zst/.bz2/.xz are decompressed",
    )
    parser.add_argument("--out", required=True, help="output token directory")
    parser.add_argument(
        "--format",
        default="auto",
        choices=KINDS,
        help="input format (auto: by suffix; text: a file is one document; "
        "lines: each line of a text file is one document)",
    )
    parser.add_argument("--field", default="text", help="JSON key / Parquet or Arrow column of the text")
    parser.add_argument(
        "--tokenizer", default="bytes", help="'bytes' (built in, vocabulary 257) or a Hugging Face tokenizer.json"
    )
    parser.add_argument(
        "--eod-token",
        metavar="TOKEN",
        help="end every document with this token of the tokenizer (default: the EOS its "
        "tokenizer_config.json names, as transformers reads it)",
    )
    parser.add_argument(
        "--bos",
        metavar="TOKEN|none",
        help="put this token before every document, or 'none' (default: the BOS the tokenizer "
        "adds to a sequence, as transformers' AutoTokenizer does)",
    )
    parser.add_argument(
        "--train-tokenizer",
        type=int,
        default=0,
        metavar="VOCAB",
        help="train a byte-level BPE of this size on the inputs and use it",
    )
    parser.add_argument(
        "--on-error",
        default="stop",
        choices=["stop", "skip"],
        help=f"a bad record stops the run (stop), or is skipped, counted and listed in OUT/{REJECTED} (skip)",
    )
    parser.add_argument(
        "--replace-invalid",
        action="store_true",
        help="replace invalid UTF-8 and lone surrogates with U+FFFD (counted) instead of treating the record as bad",
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="encoding processes (default 0: one per core, fewer for small inputs)"
    )
    parser.add_argument(
        "--shard-tokens", type=int, default=1 << 26, help="tokens per shard (shards end at document boundaries)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"megascale prep: error: {message}", file=sys.stderr)
        return 2

    if args.overrides:
        return fail(f"takes no config overrides, got {args.overrides}")
    if args.train_tokenizer and args.tokenizer != "bytes":
        return fail("pass --tokenizer or --train-tokenizer, not both")
    if args.workers < 0 or args.shard_tokens < 1:
        return fail("--workers must be >= 0 (0 = automatic) and --shard-tokens >= 1")
    options = Options(args.format, args.field, args.on_error, args.replace_invalid, args.eod_token, args.bos)
    try:
        manifest = prepare(
            args.inputs,
            args.out,
            args.tokenizer,
            options=options,
            workers=args.workers,
            train_vocab=args.train_tokenizer,
            shard_tokens=args.shard_tokens,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except (DataError, OSError) as exc:  # OSError: unreadable input, no space left, ...
        return fail(str(exc))
    except BrokenProcessPool:
        print(
            "megascale prep: a worker process died (killed for memory? see dmesg); nothing was written", file=sys.stderr
        )
        return 1
    except LostData as exc:
        print(f"megascale prep: {exc}", file=sys.stderr)
        return 1
    print(summary(manifest, args.out))
    return 0


def summary(manifest: dict, out: str) -> str:
    """What was written, what was read and everything that did not become tokens."""
    tok, counts, source = manifest["tokenizer"], manifest["counts"], manifest["source"]
    lines = [
        f"wrote {out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in "
        f"{len(manifest['shards'])} shard(s) of {manifest['dtype']}, tokenizer {tok['name']} "
        f"(vocabulary {tok['vocab_size']})",
        f"documents end with id {tok['eod']}"
        + (f" {tok['eod_token']!r}" if tok.get("eod_token") else "")
        + (
            f" and start with BOS id {tok['bos']} {tok.get('bos_token')!r}"
            if tok.get("bos") is not None
            else ", no BOS"
        ),
        f"read {counts['bytes_read']:,} bytes from {source['files']} file(s): {counts['documents_in']:,} documents",
    ]
    not_written = {
        "empty documents": counts["empty_documents"],
        "documents with no tokens": counts["no_token_documents"],
        "blank lines": counts["blank_lines"],
        "invalid bytes replaced by U+FFFD": counts["replaced_invalid"],
        "end-of-document tokens inside documents": counts["eod_inside_documents"],
        "files ignored (unknown suffix)": source["ignored_files"],
    }
    lines += [f"  {name}: {n:,}" for name, n in not_written.items() if n]
    skipped = counts["skipped"]
    if skipped:
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in skipped.items())
        lines.append(f"  skipped {sum(skipped.values()):,} records ({reasons}); where: {out}/{REJECTED}")
    lines.append(f"train with --data.path={out} --model.vocab_size={tok['vocab_size']}")
    return "\n".join(lines)
