"""`megascale prep` round trips, tokenizers, workers, the default corpus and mixtures."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from megascale.cli import main
from megascale.config import ConfigError, load_config
from megascale.data import EOD, build_loaders, ensure_default_corpus
from megascale.data.corpus import stdlib_files
from megascale.data.prep import prepare
from megascale.data.shards import TokenStore
from megascale.data.tokenizer import load_tokenizer
from tests.data.conftest import (
    bpe_tokenizer,
    job,
    library_encoding,
    make_docs,
    wordpiece_tokenizer,
    write_bytes_dataset,
    written_documents,
)


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
    rc = main(["prep", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--shard-tokens", "1000", "--quiet"])
    assert rc == 0
    got, store = documents_of(tmp_path / "out")
    assert [bytes(d[:-1].astype(np.uint8)) for d in got] == docs  # sorted path order
    manifest = store.manifest
    assert manifest["documents"] == 40 and len(manifest["shards"]) > 2
    assert manifest["tokenizer"] == {"kind": "bytes", "name": "bytes", "vocab_size": 257, "eod": EOD}
    assert manifest["dtype"] == "<u2" and all(len(s["sha256"]) == 64 for s in manifest["shards"])
    for i, shard in enumerate(manifest["shards"]):  # shards end at document boundaries
        assert store.memmap(i)[-1] == EOD and int((store.memmap(i) == EOD).sum()) == shard["documents"]


def test_saved_truncation_and_padding_are_switched_off(tmp_path):
    """A tokenizer.json as model repositories ship it (max_length 16, padded to 16) must not cut
    or pad documents: prep's output equals the library encoding every document in full."""
    docs = [d.decode() for d in make_docs(30, seed=4)]
    tok = bpe_tokenizer(docs)
    tok.enable_truncation(16)
    tok.enable_padding(length=16, pad_id=3, pad_token="<pad>")
    tok.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    said: list[str] = []
    manifest = prepare(
        [str(tmp_path / "a.jsonl")], tmp_path / "out", str(tmp_path / "tokenizer.json"), progress=False, say=said.append
    )
    full = library_encoding(tok, docs)
    assert max(map(len, full)) > 100  # far past the saved max_length
    assert written_documents(tmp_path / "out") == full
    assert manifest["counts"]["tokens_in"] == sum(map(len, full))
    assert len(said) == 1 and "truncation to 16 tokens and padding to 16 tokens" in said[0]
    assert manifest["notes"] == [said[0].removeprefix("megascale prep: note: ")]


def test_documents_that_become_no_tokens_are_counted(tmp_path):
    docs = [d.decode() for d in make_docs(20, seed=6)]
    wordpiece_tokenizer(docs).save(str(tmp_path / "wp.json"))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hello", " \t ", "", "x"]))
    manifest = prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", str(tmp_path / "wp.json"), progress=False)
    counts = manifest["counts"]
    assert (counts["documents_in"], counts["documents"], counts["no_token_documents"], counts["empty_documents"]) == (
        4,
        2,
        1,
        1,
    )


def test_progress_bar_total_is_the_input_bytes_of_a_single_file(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps({"text": d.decode()}) + "\n" for d in make_docs(60)))
    shown = io.StringIO()
    prepare([str(path)], tmp_path / "out", progress=Console(file=shown, width=100))
    kb = path.stat().st_size / 1000
    assert f"{kb:.1f}/{kb:.1f} kB" in shown.getvalue()


def test_trained_bpe_round_trip_and_config_match(tmp_path):
    docs = [d.decode() for d in make_docs(150, seed=9)]
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    manifest = prepare([str(tmp_path / "a.jsonl")], tmp_path / "bpe", train_vocab=300, progress=False)
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
    unquoted = load_config(None, [f"--data.mixture={{{a}=3.0,{b}=1.0}}"])  # no TOML quoting needed
    assert unquoted.data.mixture == cfg.data.mixture == load_config(None, [f"--data.mixture={a}=3,{b}=1"]).data.mixture
    with pytest.raises(ConfigError, match=r"write --data\.mixture=PATH=WEIGHT,PATH=WEIGHT"):
        load_config(None, [f"--data.mixture={a}"])
    train, _ = build_loaders(cfg, None)
    batches = [train.next_batch() for _ in range(60)]
    # only dataset a has lower-case ASCII letters
    lower = sum(int(((s >= 97) & (s <= 122)).any()) for bt in batches for s in bt.inputs.reshape(-1, 32))
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


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
