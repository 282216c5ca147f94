"""`megascale prep` round trips, tokenizers, workers, the default corpus and mixtures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megascale.cli import main
from megascale.data import EOD, build_loaders, ensure_default_corpus
from megascale.data.corpus import stdlib_files
from megascale.data.prep import prepare
from megascale.data.shards import TokenStore
from megascale.data.tokenizer import load_tokenizer
from tests.data.conftest import job, make_docs, write_bytes_dataset


def documents_of(root: Path) -> tuple[list[np.ndarray], TokenStore]:
    """The stream cut at every end-of-document token (the last token is always one)."""
    store = TokenStore(root)
    stream = store.read(0, store.tokens)
    assert stream[-1] == store.eod
    cuts = np.flatnonzero(stream == store.eod)
    return np.split(stream, cuts + 1)[:-1], store


def test_text_round_trip_byte_level_over_several_shards(tmp_path):
    docs = make_docs(40, seed=3)
    for i, doc in enumerate(docs):
        (tmp_path / "in" / f"d{i // 10}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / f"d{i // 10}" / f"{i:03d}.txt").write_bytes(doc)
    rc = main(["prep", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
               "--shard-tokens", "1000", "--quiet"])
    assert rc == 0
    got, store = documents_of(tmp_path / "out")
    assert [bytes(d[:-1].astype(np.uint8)) for d in got] == docs  # sorted path order
    manifest = store.manifest
    assert manifest["documents"] == 40 and len(manifest["shards"]) > 2
    assert manifest["tokenizer"] == {"kind": "bytes", "name": "bytes", "vocab_size": 257,
                                     "eod": EOD}
    assert manifest["dtype"] == "<u2" and all(len(s["sha256"]) == 64 for s in manifest["shards"])
    for i, shard in enumerate(manifest["shards"]):  # shards end at document boundaries
        assert store.memmap(i)[-1] == EOD and int((store.memmap(i) == EOD).sum()) == shard["documents"]


def test_jsonl_and_parquet_with_workers_match_one_process(tmp_path):
    docs = [d.decode() for d in make_docs(200, seed=5)]
    with open(tmp_path / "a.jsonl", "w") as f:
        for i, doc in enumerate(docs[:120]):
            f.write(json.dumps({"id": i, "body": doc}) + ("\n\n" if i % 7 == 0 else "\n"))
    pq.write_table(pa.table({"body": docs[120:]}), tmp_path / "b.parquet", row_group_size=16)
    one = prepare([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], tmp_path / "one",
                  options=_opts("body"), progress=False)
    two = prepare([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], tmp_path / "two",
                  options=_opts("body"), workers=2, progress=False)
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
    got, _ = documents_of(tmp_path / "two")
    assert [bytes(d[:-1].astype(np.uint8)).decode() for d in got] == docs


def test_trained_bpe_round_trip_and_config_match(tmp_path):
    docs = [d.decode() for d in make_docs(150, seed=9)]
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    manifest = prepare([str(tmp_path / "a.jsonl")], tmp_path / "bpe", train_vocab=300,
                       progress=False)
    tok_path = tmp_path / "bpe" / "tokenizer.json"
    tok = load_tokenizer(str(tok_path))
    assert manifest["tokenizer"]["vocab_size"] == tok.vocab_size == 300
    assert manifest["tokenizer"]["sha256"] == tok.identity()["sha256"]
    got, store = documents_of(tmp_path / "bpe")
    assert store.tokens < sum(len(d.encode()) for d in docs)  # merges learned: fewer tokens
    assert [tok.decode(d[:-1]).decode() for d in got] == docs
    cfg = job(tmp_path / "bpe", model__vocab_size=300, data__tokenizer=str(tok_path))
    train, _ = build_loaders(cfg, None)
    assert int(train.next_batch().inputs.max()) < 300
    train.close()


def test_default_corpus_is_the_stdlib_built_once(tmp_path):
    root = ensure_default_corpus(tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    stdlib, files = stdlib_files()
    assert manifest["source"]["files"] == manifest["documents"] == len(files) > 100
    assert not any("test" in p.relative_to(stdlib).parts[:-1] for p in files)
    assert manifest["tokens"] == sum(p.stat().st_size + 1 for p in files)
    assert manifest["tokenizer"]["vocab_size"] == 257
    stamp = (root / "manifest.json").stat().st_mtime_ns
    assert ensure_default_corpus(tmp_path) == root
    assert (root / "manifest.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".stdlib-bytes-")] == []
    first = files[0].read_bytes()
    store = TokenStore(root)
    assert bytes(store.read(0, len(first)).astype(np.uint8)) == first
    assert store.read(len(first), 1)[0] == EOD
    store.close()


def test_mixture_follows_weights_and_resumes(tmp_path):
    a = write_bytes_dataset(tmp_path / "a", make_docs(200, seed=1))
    b = write_bytes_dataset(tmp_path / "b", [d.upper() for d in make_docs(200, seed=2)])
    cfg = job(data__mixture={str(a): 3.0, str(b): 1.0})
    train, _ = build_loaders(cfg, None)
    batches = [train.next_batch() for _ in range(60)]
    # only dataset a has lower-case ASCII letters
    lower = sum(int(((s >= 97) & (s <= 122)).any()) for bt in batches
                for s in bt.inputs.reshape(-1, 32))
    assert 0.65 < lower / (60 * 8) < 0.85  # weight 3:1
    again, _ = build_loaders(cfg, None)
    for _ in range(25):
        again.next_batch()
    state = again.state_dict()
    again.close()
    resumed, _ = build_loaders(cfg, None)
    resumed.load_state_dict(state)
    for want in batches[25:]:
        assert torch.equal(resumed.next_batch().inputs, want.inputs)
    for loader in (train, resumed):
        loader.close()


def _opts(field: str):
    from megascale.data.prep import Options

    return Options(field=field)


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
