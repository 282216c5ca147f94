"""Small prepared datasets for the data tests, written with the real shard writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megascale.config import load_config
from megascale.config.schema import JobConfig
from megascale.data.shards import ShardWriter, dtype_for_vocab
from megascale.data.tokenizer import ByteTokenizer


def make_docs(n: int, seed: int = 0) -> list[bytes]:
    """Random words (ASCII and two-byte UTF-8), so that no two windows are equal."""
    rng = np.random.default_rng(seed)
    letters = [c.encode() for c in "abcdefghijklmnopqrstuvwxyz\n\u00e9\u00fc"]
    return [b"".join(letters[i] for i in rng.integers(0, len(letters), rng.integers(20, 300)))
            for _ in range(n)]


def write_bytes_dataset(root: Path, docs: list[bytes], shard_tokens: int = 4096) -> Path:
    tok = ByteTokenizer()
    writer = ShardWriter(root, dtype_for_vocab(tok.vocab_size), tok.eod, shard_tokens)
    for doc in docs:
        writer.add(tok.encode(doc))
    writer.finish(tok.identity(), {"kind": "test"})
    return root


def job(path: Path | str = "", **overrides: object) -> JobConfig:
    """A small job config; keyword `section__key=value` overrides the defaults below."""
    values: dict[str, object] = {"model.seq_len": 32, "train.global_batch": 8,
                                 "train.micro_batch": 2, "train.eval_batches": 2,
                                 "data.val_fraction": 0.1, "data.reader": "rank"}
    if path:
        values["data.path"] = str(path)
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(None, [f"--{k}={_toml(v)}" for k, v in values.items()])


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return "'" + value + "'"
    if isinstance(value, dict):
        return "{" + ", ".join(f"'{k}' = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, list[bytes]]:
    docs = make_docs(300)
    return write_bytes_dataset(tmp_path / "tokens", docs), docs
