"""`megascale data inspect DIR`: what a prepared token directory holds, and what looks wrong.

Reads the manifest (documents, tokens, tokenizer, what prep skipped) and scans the tokens (all
of them, or evenly spaced shards up to `--sample-tokens`): the document-length histogram, the
most common exact length, the most common token id. Warnings name the signs of data lost on the
way: most documents of one exact length (a tokenizer that truncates or pads), a large share of
one token id (padding), end-of-document ids inside documents, skipped records, ids past the
vocabulary. Exit status 1 with `--strict` when there is a warning.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from megascale.data.shards import DataError, TokenStore
from megascale.data.tokenizer import describe

SAME_LENGTH_SHARE = 0.5  # of documents, with at least MIN_DOCS of them
ONE_TOKEN_SHARE = 0.3  # of tokens, end-of-document ids left out
MIN_DOCS = 8


@dataclass
class Report:
    path: str
    documents: int
    tokens: int
    tokenizer: str
    scanned_tokens: int
    scanned_documents: int
    histogram: list[tuple[int, int, int]]  # (from, to exclusive, documents) over powers of two
    top_length: tuple[int, float]  # (length without the end-of-document token, share of documents)
    top_token: tuple[int, float]  # (id, share of tokens that are not end-of-document ids)
    counts: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def inspect_dir(root: str | Path, sample_tokens: int = 1 << 26) -> Report:
    store = TokenStore(root, verify=False)
    try:
        manifest = store.manifest
        shards = _sampled_shards([int(s["tokens"]) for s in manifest["shards"]], sample_tokens)
        lengths, counts, top_id = [], np.zeros(0, np.int64), 0
        for i in shards:
            tokens = np.asarray(store.memmap(i))
            ends = np.flatnonzero(tokens == store.eod)
            lengths.append(np.diff(np.concatenate(([-1], ends))) - 1)
            counts = _add_counts(counts, np.bincount(tokens))
            top_id = max(top_id, int(tokens.max()))
    finally:
        store.close()
    lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    scanned = int(counts.sum())
    report = Report(
        str(root),
        int(manifest.get("documents", 0)),
        int(manifest["tokens"]),
        describe(manifest["tokenizer"]),
        scanned,
        len(lengths_all),
        _histogram(lengths_all),
        _top_length(lengths_all),
        _top_token(counts, store.eod),
        manifest.get("counts", {}),
    )
    report.warnings = _warnings(report, manifest, top_id, scanned == report.tokens, store.vocab_size)
    return report


def _sampled_shards(sizes: list[int], budget: int) -> list[int]:
    """Every shard when they fit the budget, else evenly spaced ones (whole shards: a shard
    starts at a document boundary, so its lengths are exact)."""
    if sum(sizes) <= budget:
        return list(range(len(sizes)))
    take = max(1, min(len(sizes), budget // max(1, max(sizes))))
    return sorted({round(i * (len(sizes) - 1) / max(1, take - 1)) for i in range(take)})


def _add_counts(total: np.ndarray, more: np.ndarray) -> np.ndarray:
    if len(more) > len(total):
        total, more = more, total
    total = total.copy()
    total[: len(more)] += more
    return total


def _histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    if len(lengths) == 0:
        return []
    bins = np.zeros(int(lengths.max()).bit_length() + 1, np.int64)
    np.add.at(bins, np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))).astype(int) + 1, 0), 1)
    edges = [(0, 1)] + [(1 << (b - 1), 1 << b) for b in range(1, len(bins))]
    return [(lo, hi, int(n)) for (lo, hi), n in zip(edges, bins, strict=True)]


def _top_length(lengths: np.ndarray) -> tuple[int, float]:
    if len(lengths) == 0:
        return 0, 0.0
    values, counts = np.unique(lengths, return_counts=True)
    return int(values[counts.argmax()]), float(counts.max() / len(lengths))


def _top_token(counts: np.ndarray, eod: int) -> tuple[int, float]:
    counts = counts.copy()
    if eod < len(counts):
        counts[eod] = 0
    if counts.sum() == 0:
        return 0, 0.0
    return int(counts.argmax()), float(counts.max() / counts.sum())


def _warnings(r: Report, manifest: dict, top_id: int, full: bool, vocab: int) -> list[str]:
    out = []
    length, share = r.top_length
    if r.scanned_documents >= MIN_DOCS and share >= SAME_LENGTH_SHARE:
        out.append(
            f"{share:.0%} of documents are exactly {length} tokens long: did the tokenizer "
            f"truncate or pad them? (prep it again with this version of megascale)"
        )
    token, token_share = r.top_token
    if token_share >= ONE_TOKEN_SHARE:
        out.append(
            f"token id {token}{_token_text(manifest, token)} is {token_share:.0%} of all tokens: "
            f"padding, or a tokenizer that maps most text to one token (unknown)?"
        )
    if full and r.scanned_documents != r.documents:
        out.append(
            f"{r.scanned_documents} end-of-document tokens but {r.documents} documents: "
            f"{r.scanned_documents - r.documents} come from inside documents (text that spells the "
            f"end-of-document token)"
        )
    if top_id >= vocab:
        out.append(f"token id {top_id} is past the vocabulary of {vocab}: the shards do not match the manifest")
    skipped = sum(r.counts.get("skipped", {}).values())
    if skipped:
        out.append(
            f"prep skipped {skipped} records ({r.counts['skipped']}); see "
            f"{Path(r.path) / manifest.get('rejected', 'rejected.jsonl')}"
        )
    if r.counts.get("replaced_invalid"):
        out.append(f"{r.counts['replaced_invalid']} invalid bytes or surrogates were replaced by U+FFFD")
    if "counts" not in manifest:
        out.append("the manifest has no counts of what prep read and skipped (made by an older prep?)")
    return out + [f"note from prep: {note}" for note in manifest.get("notes", [])]


def _token_text(manifest: dict, token: int) -> str:
    """' ("<pad>")' when the tokenizer file named in the manifest is still there."""
    path = manifest["tokenizer"].get("path")
    if manifest["tokenizer"].get("kind") == "bytes":
        return f" (byte {bytes([token])!r})" if token < 256 else ""
    if not path or not Path(path).is_file():
        return ""
    from megascale.data.tokenizer import HFTokenizer

    text = HFTokenizer(path).token(token)
    return f" ({text!r})" if text is not None else ""


def render(r: Report) -> str:
    lines = [f"{r.path}: {r.documents:,} documents, {r.tokens:,} tokens", f"tokenizer: {r.tokenizer}"]
    c = r.counts
    if c:
        lines.append(
            f"prep read {c.get('bytes_read', 0):,} bytes, {c.get('documents_in', 0):,} documents; "
            f"empty {c.get('empty_documents', 0):,}, skipped {sum(c.get('skipped', {}).values()):,}, "
            f"replaced bytes {c.get('replaced_invalid', 0):,}"
        )
    part = "all" if r.scanned_tokens == r.tokens else f"{r.scanned_tokens:,} of the"
    lines.append(f"document lengths in tokens ({part} tokens scanned, {r.scanned_documents:,} documents):")
    widest = max((n for _, _, n in r.histogram), default=1) or 1
    for lo, hi, n in r.histogram:
        label = f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}"
        lines.append(f"  {label:>15} {n:>10,} {'#' * round(40 * n / widest)}")
    lines.append(
        f"most common length: {r.top_length[0]} tokens ({r.top_length[1]:.1%} of documents); "
        f"most common token id: {r.top_token[0]} ({r.top_token[1]:.1%} of tokens)"
    )
    lines += [f"warning: {w}" for w in r.warnings] or ["no warnings"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    look = sub.add_parser("inspect", help="documents, tokens, tokenizer, length histogram, warnings")
    look.add_argument("path", help="a prepared token directory (megascale prep --out)")
    look.add_argument(
        "--sample-tokens",
        type=int,
        default=1 << 26,
        help="scan at most about this many tokens (whole shards, evenly spaced)",
    )
    look.add_argument("--json", action="store_true", help="print the report as JSON")
    look.add_argument("--strict", action="store_true", help="exit 1 when there is a warning")


def run(args: argparse.Namespace) -> int:
    try:
        report = inspect_dir(args.path, args.sample_tokens)
    except DataError as exc:
        print(f"megascale data inspect: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report), indent=2) if args.json else render(report))
    return 1 if args.strict and report.warnings else 0
