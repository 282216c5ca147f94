"""`megascale data inspect`: the check that would have caught documents cut by a tokenizer."""

from __future__ import annotations

import json

from megascale.cli import main
from megascale.data.prep import prepare
from megascale.data.shards import ShardWriter, dtype_for_vocab
from megascale.data.tokenizer import load_tokenizer
from tests.data.conftest import bpe_tokenizer, make_docs


def test_inspect_a_healthy_dataset(tmp_path, capsys):
    docs = [d.decode() for d in make_docs(50, seed=2)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + '{"text": ""}\n')
    bpe_tokenizer(docs).save(str(tmp_path / "tokenizer.json"))
    manifest = prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", str(tmp_path / "tokenizer.json"), progress=False)
    assert main(["data", "inspect", str(tmp_path / "out"), "--strict"]) == 0
    text = capsys.readouterr().out
    sha = manifest["tokenizer"]["sha256"][:12]
    assert f"out: 50 documents, {manifest['tokens']:,} tokens" in text
    assert (
        f"tokenizer: '{tmp_path.name}/tokenizer.json' (BPE, vocabulary 400, end-of-document id 0 "
        f"'<|endoftext|>', sha256 {sha}" in text
    )
    assert "51 documents; empty 1, skipped 0" in text and "document lengths in tokens (all tokens" in text
    assert text.rstrip().endswith("no warnings")
    assert main(["data", "inspect", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sum(n for _, _, n in report["histogram"]) == report["scanned_documents"] == 50


def test_inspect_warns_about_truncated_and_padded_documents(tmp_path, capsys):
    """Shards written the way prep used to: the library encoding with the file's saved
    truncation and padding on (every document 12 tokens, most of them padding)."""
    docs = [d.decode() for d in make_docs(40, seed=3)]
    tok = bpe_tokenizer(docs)
    pad = tok.token_to_id("<|endoftext|>") + 1
    tok.enable_truncation(12)
    tok.enable_padding(length=12, pad_id=pad, pad_token=tok.id_to_token(pad))
    tok.save(str(tmp_path / "tokenizer.json"))
    short = ["a", "b c", "d"] * 10 + docs[:10]
    identity = load_tokenizer(str(tmp_path / "tokenizer.json")).identity()
    writer = ShardWriter(tmp_path / "cut", dtype_for_vocab(identity["vocab_size"]), identity["eod"])
    for encoding in tok.encode_batch(short, add_special_tokens=False):
        writer.add(encoding.ids)
    writer.finish(identity, {"kind": "test"})
    assert main(["data", "inspect", str(tmp_path / "cut"), "--strict"]) == 1
    text = capsys.readouterr().out
    assert "warning: 100% of documents are exactly 12 tokens long: did the tokenizer truncate or pad them?" in text
    assert f"warning: token id {pad} ({tok.id_to_token(pad)!r}) is " in text and "padding" in text
    assert "warning: the manifest has no counts of what prep read and skipped" in text
