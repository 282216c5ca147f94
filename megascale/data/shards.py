"""Token shards on disk: raw little-endian arrays plus a `manifest.json` that describes them.

A prepared dataset is a directory:

    manifest.json        source, tokenizer identity, dtype, documents, tokens, one entry per shard
    shard_00000.bin      tokens of whole documents, each followed by the end-of-document token
    ...

The shard files are plain arrays (`np.memmap` opens them); the manifest carries each shard's
size and sha256 so that a missing, truncated or corrupted shard is found before training.
Readers use `pread`, which is thread-safe (the prefetch thread) and counts as I/O per process.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class DataError(ValueError):
    """Bad input data: names the file (and line) and what is wrong with it."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise DataError(f"vocabulary of {vocab_size} tokens does not fit in 32 bits")


def with_eod(ids: np.ndarray, lengths: np.ndarray, eod: int, dtype: np.dtype, bos: int | None = None) -> np.ndarray:
    """Documents laid end to end (`ids`, `lengths` tokens each) with `eod` after each one (and
    `bos` before each one, unless None)."""
    extra = 1 if bos is None else 2
    starts = np.cumsum(lengths) - lengths + np.arange(len(lengths)) * extra
    eod_at = starts + lengths + extra - 1
    out = np.empty(len(ids) + len(lengths) * extra, dtype=dtype)
    mask = np.ones(len(out), dtype=bool)
    mask[eod_at] = False
    if bos is not None:
        mask[starts] = False
        out[starts] = bos
    out[mask] = ids
    out[eod_at] = eod
    return out


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class ShardWriter:
    """Appends whole documents to shards of about `shard_tokens` tokens each.

    A shard ends at the first document end at or past `shard_tokens`, wherever the batches of
    documents handed in begin and end: the shards depend on the documents only, not on how the
    work was divided (prep's output is the same for any number of workers)."""

    def __init__(self, out_dir: Path, dtype: np.dtype, eod: int, shard_tokens: int = 1 << 26):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.dtype, self.eod, self.shard_tokens = np.dtype(dtype), eod, shard_tokens
        self.shards: list[dict] = []
        self.tokens_written = self.documents_written = 0
        self._file = None
        self._tokens = self._docs = 0

    def add(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Write one document and its end-of-document token."""
        ids = np.asarray(tokens, dtype=np.int64)
        self.add_packed(with_eod(ids, np.array([len(ids)]), self.eod, self.dtype), np.array([len(ids) + 1]))

    def add_packed(self, packed: np.ndarray, lengths: np.ndarray) -> None:
        """Write whole documents laid end to end; `lengths` counts each one's end-of-document token."""
        packed = np.ascontiguousarray(packed, dtype=self.dtype)
        ends = np.cumsum(lengths)
        pos, doc = 0, 0
        while doc < len(ends):
            if self._file is None:
                self._open_shard()
            room = self.shard_tokens - self._tokens
            last = min(int(np.searchsorted(ends, pos + room)), len(ends) - 1)  # first end that fills it
            stop = int(ends[last])
            view = memoryview(packed[pos:stop]).cast("B")
            self._file.write(view)
            self._hash.update(view)
            self._tokens += stop - pos
            self._docs += last + 1 - doc
            self.tokens_written += stop - pos
            self.documents_written += last + 1 - doc
            if self._tokens >= self.shard_tokens:
                self._close_shard()
            pos, doc = stop, last + 1

    def add_open(self, packed: np.ndarray) -> None:
        """Write the first tokens of a document that goes on in the next call (a long document's
        pieces): the shard cannot end inside it."""
        if self._file is None:
            self._open_shard()
        view = memoryview(np.ascontiguousarray(packed, dtype=self.dtype)).cast("B")
        self._file.write(view)
        self._hash.update(view)
        self._tokens += len(packed)
        self.tokens_written += len(packed)

    @property
    def pending_tokens(self) -> int:
        """Tokens in the shard being written."""
        return self._tokens if self._file is not None else 0

    def _open_shard(self) -> None:
        self._name = f"shard_{len(self.shards):05d}.bin"
        self._file = open(self.out_dir / self._name, "wb")  # noqa: SIM115 - closed in _close_shard
        self._hash = hashlib.sha256()
        self._tokens = self._docs = 0

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        path = self.out_dir / self._name
        self.shards.append(
            {
                "file": self._name,
                "documents": self._docs,
                "tokens": self._tokens,
                "bytes": path.stat().st_size,
                "sha256": self._hash.hexdigest(),
            }
        )

    def finish(self, tokenizer: dict, source: dict, **extra: object) -> dict:
        """Close the last shard and write the manifest (with `extra` keys); returns it."""
        self._close_shard()
        manifest = {
            "format": FORMAT_VERSION,
            "source": source,
            "tokenizer": tokenizer,
            "dtype": self.dtype.str,
            "eod": self.eod,
            "documents": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            **extra,
            "shards": self.shards,
        }
        if manifest["tokens"] == 0:
            raise DataError(f"no documents were written to {self.out_dir} (empty input)")
        tmp = self.out_dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp, self.out_dir / MANIFEST)
        return manifest


@dataclass
class _Shard:
    path: Path
    start: int  # first token's index in the whole stream
    tokens: int
    fd: int


class TokenStore:
    """The token stream of a prepared directory: all shards concatenated, read by range."""

    def __init__(self, root: str | Path, verify: bool = True):
        self.root = Path(root)
        self.shards: list[_Shard] = []
        self.manifest = read_manifest(self.root)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.eod = int(self.manifest["eod"])
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        start = 0
        for entry in self.manifest["shards"]:
            path = self.root / entry["file"]
            check_shard(path, entry, self.dtype, verify)
            fd = os.open(path, os.O_RDONLY)
            self.shards.append(_Shard(path, start, int(entry["tokens"]), fd))
            start += int(entry["tokens"])
        self.tokens = start
        self._starts = np.array([s.start for s in self.shards], dtype=np.int64)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start+count) of the stream as int64 (may span shards)."""
        if start < 0 or start + count > self.tokens:
            raise IndexError(f"tokens [{start}, {start + count}) outside 0..{self.tokens}")
        out = np.empty(count, dtype=np.int64)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < count:
            shard = self.shards[i]
            offset = start + done - shard.start
            n = min(count - done, shard.tokens - offset)
            raw = os.pread(shard.fd, n * self.dtype.itemsize, offset * self.dtype.itemsize)
            out[done : done + n] = np.frombuffer(raw, dtype=self.dtype)
            done += n
            i += 1
        return out

    def memmap(self, shard: int) -> np.memmap:
        """Zero-copy view of one shard (tools and tests)."""
        return np.memmap(self.shards[shard].path, dtype=self.dtype, mode="r")

    def close(self) -> None:
        for shard in self.shards:
            if shard.fd >= 0:
                os.close(shard.fd)
                shard.fd = -1

    def __del__(self) -> None:
        self.close()


def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist (run `megascale prep` first)")
    if not path.is_file():
        raise DataError(f"{path} is missing: {root} is not a prepared token directory")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from exc
    for key in ("dtype", "eod", "tokenizer", "shards", "tokens"):
        if key not in manifest:
            raise DataError(f"{path} lacks the key {key!r}")
    if not manifest["shards"] or manifest["tokens"] == 0:
        raise DataError(f"{path} lists no tokens (empty dataset)")
    return manifest


def check_shard(path: Path, entry: dict, dtype: np.dtype, verify: bool) -> None:
    """Missing, truncated or (with `verify`) corrupted shards stop here, naming the file."""
    if not path.is_file():
        raise DataError(f"shard {path} listed in the manifest is missing")
    size = path.stat().st_size
    expected = int(entry["tokens"]) * dtype.itemsize
    if size != expected:
        raise DataError(
            f"shard {path} is truncated or padded: {size} bytes on disk, the manifest says "
            f"{expected} ({entry['tokens']} tokens of {dtype})"
        )
    if verify and sha256_file(path) != entry["sha256"]:
        raise DataError(f"shard {path} is corrupted: its sha256 does not match the manifest")
