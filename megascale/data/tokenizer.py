"""Tokenizers for `prep` and the manifest's record of which one made a dataset.

Byte-level is built in (ids 0..255 are the bytes, 256 ends a document). Any Hugging Face
`tokenizer.json` goes through the `tokenizers` package, with the truncation and padding that
many shipped files carry switched off: prep encodes every document in full. Its end-of-document
and beginning-of-sequence tokens come from its own files, as `transformers.AutoTokenizer` reads
them (`special_tokens.py`), unless the user names others. A dataset's identity in the manifest
(name, path, model, vocabulary, end-of-document and BOS ids, the file's sha256) lets it be
matched against the tokenizer a model is configured with.
"""

from __future__ import annotations

import hashlib
from itertools import chain
from pathlib import Path
from typing import Protocol

import numpy as np

from megascale.data.shards import DataError
from megascale.data.special_tokens import SpecialTokens

EOD = 256  # byte-level end-of-document token
BYTE_VOCAB = 257


class Tokenizer(Protocol):
    vocab_size: int
    eod: int
    bos: int | None  # put before every document (and a generate prompt), or None
    takes_text: bool  # documents go in as str (True) or as raw bytes (False)
    notes: list[str]  # what prep changed about the tokenizer as loaded (said once, kept in the manifest)

    def encode_batch(self, docs: list) -> tuple[np.ndarray, np.ndarray]: ...
    def decode(self, ids: np.ndarray) -> bytes: ...
    def identity(self) -> dict: ...


class ByteTokenizer:
    """Each byte is its own token; lossless for any input, including invalid UTF-8."""

    vocab_size = BYTE_VOCAB
    eod = EOD
    bos = None
    takes_text = False
    notes: list[str] = []

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    def encode_batch(self, docs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(every document's ids one after another, each document's length)."""
        return (
            np.frombuffer(b"".join(docs), dtype=np.uint8),
            np.fromiter(map(len, docs), dtype=np.int64, count=len(docs)),
        )

    def decode(self, ids: np.ndarray) -> bytes:
        return np.asarray(ids, dtype=np.uint8).tobytes()

    def identity(self) -> dict:
        return {"kind": "bytes", "name": "bytes", "vocab_size": self.vocab_size, "eod": self.eod}


class HFTokenizer:
    """A Hugging Face `tokenizer.json`; documents end with its EOS token (added if absent)."""

    takes_text = True

    def __init__(self, path: str | Path, eod_token: str | None = None, bos: str | None = None):
        """`eod_token` / `bos` (a token, or "none" for no BOS) override the tokenizer's own choice."""
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        raw = self.path.read_bytes()
        try:
            self._tok = _Tok.from_str(raw.decode("utf-8", errors="replace"))
        except Exception as exc:  # tokenizers raises plain Exception with serde's message
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(
                f"tokenizer file {self.path} is not a tokenizer.json the tokenizers library "
                f"can load ({reason}); pass the tokenizer.json saved by tokenizers or "
                f"transformers' save_pretrained, or 'bytes'"
            ) from exc
        self.notes = self._switch_off_truncation_and_padding()
        self.special = SpecialTokens(self._tok, self.path, eod_token, bos)
        self.notes += self.special.notes
        self.eod_token, self.eod = self.special.eod_token, self.special.eod
        self.bos_token, self.bos = self.special.bos_token, self.special.bos
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True) + (self.eod_token is None)
        self.sha256 = hashlib.sha256(raw).hexdigest()

    def _switch_off_truncation_and_padding(self) -> list[str]:
        notes = []
        if self._tok.truncation is not None:
            notes.append(f"truncation to {self._tok.truncation['max_length']} tokens")
            self._tok.no_truncation()
        if self._tok.padding is not None:
            length = self._tok.padding.get("length")
            notes.append(f"padding to {length} tokens" if length else "padding")
            self._tok.no_padding()
        if not notes:
            return []
        return [
            f"{self.path} has {' and '.join(notes)} saved in it; prep switched them off and "
            f"encodes every document in full"
        ]

    def encode(self, text: bytes) -> np.ndarray:
        return self.encode_batch([text.decode()])[0]

    def encode_batch(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(every document's ids one after another, each document's length); no special tokens
        are added. A str holding a lone surrogate makes the library raise TypeError."""
        ids = [e.ids for e in self._tok.encode_batch_fast(docs, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())), lengths

    def decode(self, ids: np.ndarray) -> bytes:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False).encode()

    def token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def identity(self) -> dict:
        model = type(self._tok.model).__name__  # BPE, WordPiece, Unigram, WordLevel (no re-serialising)
        return {
            "kind": "hf",
            "name": f"{self.path.resolve().parent.name}/{self.path.name}",
            "path": str(self.path.resolve()),
            "model": model,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "eod_token": self.eod_token,
            "bos": self.bos,
            "bos_token": self.bos_token,
            "chosen": self.special.chosen,
            "sha256": self.sha256,
        }


def describe(identity: dict) -> str:
    """One line that tells two tokenizers apart: name, model, vocabulary, EOD id, hash, path."""
    if identity.get("kind") == "bytes":
        return (
            f"'bytes' (built-in byte-level, vocabulary {identity.get('vocab_size')}, "
            f"end-of-document id {identity.get('eod')})"
        )
    eod_token = f" {identity['eod_token']!r}" if identity.get("eod_token") else ""
    bos = f", BOS id {identity['bos']} {identity.get('bos_token')!r}" if identity.get("bos") is not None else ""
    sha = str(identity.get("sha256", ""))[:12]
    where = f", {identity['path']}" if identity.get("path") else ""
    return (
        f"{identity.get('name')!r} ({identity.get('model', 'hf')}, vocabulary "
        f"{identity.get('vocab_size')}, end-of-document id {identity.get('eod')}{eod_token}{bos}, "
        f"sha256 {sha}{where})"
    )


def load_tokenizer(spec: str, eod_token: str | None = None, bos: str | None = None) -> ByteTokenizer | HFTokenizer:
    """`bytes` or a path to a `tokenizer.json`; `eod_token`/`bos` as the user chose them (None: the
    tokenizer's own)."""
    if spec in ("", "bytes", "byte"):
        if eod_token or bos not in (None, "none"):
            raise DataError(
                "the built-in 'bytes' tokenizer has a fixed end-of-document id (256) and no BOS: "
                "--eod-token and --bos need a tokenizer.json"
            )
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist (pass a tokenizer.json or 'bytes')")
    return HFTokenizer(path, eod_token, bos)


def manifest_tokenizer(identity: dict, spec: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a manifest's identity describes (or the file `spec` with the choices the user
    made for that data: --eod-token, --bos)."""
    spec = spec or ("bytes" if identity.get("kind") == "bytes" else str(identity["path"]))
    chosen = (identity.get("chosen") or {}) if spec not in ("", "bytes", "byte") else {}
    return load_tokenizer(spec, chosen.get("eod_token"), chosen.get("bos"))
