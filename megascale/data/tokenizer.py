"""Tokenizers for `prep` and the manifest's record of which one made a dataset.

Byte-level is built in (ids 0..255 are the bytes, 256 ends a document). Any Hugging Face
`tokenizer.json` goes through the `tokenizers` package; its identity in the manifest is the
file's sha256, so a dataset can be matched against the tokenizer a model is configured with.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np

EOD = 256  # byte-level end-of-document token
BYTE_VOCAB = 257
EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<eod>")


class Tokenizer(Protocol):
    vocab_size: int
    eod: int

    def encode(self, text: bytes) -> np.ndarray: ...
    def decode(self, ids: np.ndarray) -> bytes: ...
    def identity(self) -> dict: ...


class ByteTokenizer:
    """Each byte is its own token; lossless for any input, including invalid UTF-8."""

    vocab_size = BYTE_VOCAB
    eod = EOD

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    def decode(self, ids: np.ndarray) -> bytes:
        return np.asarray(ids, dtype=np.uint8).tobytes()

    def identity(self) -> dict:
        return {"kind": "bytes", "name": "bytes", "vocab_size": self.vocab_size, "eod": self.eod}


class HFTokenizer:
    """A Hugging Face `tokenizer.json`; documents end with its EOS token (added if absent)."""

    def __init__(self, path: str | Path, eod_token: str | None = None):
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        self._tok = _Tok.from_file(str(self.path))
        names = [eod_token] if eod_token else list(EOD_NAMES)
        found = [self._tok.token_to_id(n) for n in names]
        ids = [i for i in found if i is not None]
        if ids:
            self.eod = ids[0]
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        else:  # no EOS in the vocabulary: one id past the end
            self.eod = self._tok.get_vocab_size(with_added_tokens=True)
            self.vocab_size = self.eod + 1
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()

    def encode(self, text: bytes) -> np.ndarray:
        ids = self._tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: np.ndarray) -> bytes:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False).encode()

    def identity(self) -> dict:
        return {"kind": "hf", "name": self.path.name, "vocab_size": self.vocab_size,
                "eod": self.eod, "sha256": self.sha256}


def load_tokenizer(spec: str, eod_token: str | None = None) -> Tokenizer:
    """`bytes` or a path to a `tokenizer.json`."""
    if spec in ("", "bytes", "byte"):
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist (or use 'bytes')")
    return HFTokenizer(path, eod_token)
