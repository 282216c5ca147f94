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
    return [b"".join(letters[i] for i in rng.integers(0, len(letters), rng.integers(20, 300))) for _ in range(n)]


def write_bytes_dataset(root: Path, docs: list[bytes], shard_tokens: int = 4096) -> Path:
    tok = ByteTokenizer()
    writer = ShardWriter(root, dtype_for_vocab(tok.vocab_size), tok.eod, shard_tokens)
    for doc in docs:
        writer.add(tok.encode(doc))
    writer.finish(tok.identity(), {"kind": "test"})
    return root


def job(path: Path | str = "", **overrides: object) -> JobConfig:
    """A small job config; keyword `section__key=value` overrides the defaults below."""
    values: dict[str, object] = {
        "model.seq_len": 32,
        "train.global_batch": 8,
        "train.micro_batch": 2,
        "train.eval_batches": 2,
        "data.val_fraction": 0.1,
        "data.reader": "rank",
    }
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


def bpe_tokenizer(corpus: list[str], vocab: int = 400):
    """A byte-level BPE with an <|endoftext|> token, trained by the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return tok


def wordpiece_tokenizer(corpus: list[str], vocab: int = 300):
    """A BERT-style WordPiece (lower-cased, accents stripped, [UNK] for the rest), no EOS token."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        corpus, trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    )
    return tok


def library_encoding(tok, docs: list[str]) -> list[list[int]]:
    """Each document encoded in full, one at a time, by the library itself."""
    tok.no_truncation()
    tok.no_padding()
    return [tok.encode(d, add_special_tokens=False).ids for d in docs]


def written_documents(root: Path) -> list[list[int]]:
    """The documents of a prepared directory, cut by the manifest's per-document layout: every
    document is followed by the end-of-document id, and no test text spells that token."""
    from megascale.data.shards import TokenStore

    store = TokenStore(root)
    stream = store.read(0, store.tokens)
    store.close()
    cuts = np.flatnonzero(stream == store.eod)
    assert len(cuts) == store.manifest["documents"] and stream[-1] == store.eod
    return [d[:-1].tolist() for d in np.split(stream, cuts + 1)[:-1]]
