"""Every bad input stops with an error that names the file (and line), before training."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascale.cli import main
from megascale.data import DataError, build_loaders
from megascale.data.prep import prepare
from megascale.data.tokenizer import load_tokenizer
from tests.data.conftest import job, make_docs, write_bytes_dataset


@pytest.fixture
def two_shards(tmp_path):
    return write_bytes_dataset(tmp_path / "tokens", make_docs(200), shard_tokens=10_000)


def test_missing_shard(two_shards):
    (two_shards / "shard_00001.bin").unlink()
    with pytest.raises(DataError, match=r"shard .*shard_00001\.bin listed in the manifest is missing"):
        build_loaders(job(two_shards), None)


def test_truncated_shard(two_shards):
    path = two_shards / "shard_00000.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"shard_00000\.bin is truncated"):
        build_loaders(job(two_shards), None)


def test_corrupted_shard(two_shards):
    path = two_shards / "shard_00001.bin"
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"shard_00001\.bin is corrupted: its sha256"):
        build_loaders(job(two_shards), None)


def test_manifest_tokenizer_differs_from_the_config(two_shards, tmp_path):
    with pytest.raises(
        DataError,
        match=r"manifest\.json: tokenizer 'bytes' has 257 tokens but "
        r"model\.vocab_size=50304",
    ):
        build_loaders(job(two_shards, model__vocab_size=50304), None)
    docs = [d.decode() for d in make_docs(50)]
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    prepare([str(tmp_path / "a.jsonl")], tmp_path / "bpe", train_vocab=280, progress=False)
    tok = tmp_path / "bpe" / "tokenizer.json"
    sha = load_tokenizer(str(tok)).identity()["sha256"][:12]
    with pytest.raises(DataError) as caught:
        build_loaders(job(two_shards, data__tokenizer=str(tok)), None)
    assert str(caught.value) == (
        f"{two_shards}/manifest.json: made with tokenizer 'bytes' (built-in byte-level, vocabulary 257, "
        f"end-of-document id 256), but data.tokenizer={tok} is 'bpe/tokenizer.json' (BPE, vocabulary 280, "
        f"end-of-document id 0 '<|endoftext|>', sha256 {sha}, {tok.resolve()}) (they differ in kind, vocabulary, "
        f"end-of-document id, sha256); prep the data with that tokenizer or set data.tokenizer to the one the "
        f"data was made with"
    )
    mixture = {str(two_shards): 1.0, str(tmp_path / "bpe"): 1.0}
    with pytest.raises(
        DataError,
        match=r"data\.mixture: .*bpe was made with tokenizer 'bpe-280 \(trained by "
        r"prep, tokenizer\.json\)' \(BPE, vocabulary 280, .*, sha256 \w{12}, "
        r"\S*/bpe/tokenizer\.json\) but .*tokens with 'bytes' \(built-in byte-level",
    ):
        build_loaders(job(data__mixture=mixture, model__vocab_size=280), None)


def test_the_model_vocabulary_may_be_up_to_128_larger(two_shards):
    """docs/interop.md's rule: a model with added rows (Mistral's 32,001 over its 32,000-token
    tokenizer) trains on the tokenizer's data; 129 more is refused."""
    build_loaders(job(two_shards, model__vocab_size=257 + 128), None)[0].close()
    with pytest.raises(DataError, match=r"has 257 tokens but model\.vocab_size=386; .* \(or up to 128 more"):
        build_loaders(job(two_shards, model__vocab_size=257 + 129), None)


def test_not_a_prepared_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty/manifest\.json is missing"):
        build_loaders(job(tmp_path / "empty"), None)
    with pytest.raises(DataError, match=r"nowhere does not exist"):
        build_loaders(job(tmp_path / "nowhere"), None)


def test_empty_inputs(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match=r"no input files found in .*dir \(empty input\)"):
        prepare([str(tmp_path / "dir")], tmp_path / "out", progress=False)
    (tmp_path / "blank.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"blank\.txt, .*blank\.jsonl hold no text \(empty input\)"):
        prepare([str(tmp_path / "blank.txt"), str(tmp_path / "blank.jsonl")], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and len(list(tmp_path.iterdir())) == 3


def test_jsonl_line_without_the_field_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n{"body": "c"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:4: no field 'text'"):
        prepare([str(path)], tmp_path / "out", progress=False)
    path.write_text('{"text": "a"}\n{"text": "b"\n')
    with pytest.raises(DataError, match=r"c\.jsonl:2: not valid JSON"):
        prepare([str(path)], tmp_path / "out", progress=False)
    assert main(["prep", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "c.jsonl:2: not valid JSON" in capsys.readouterr().err
    (tmp_path / "meta.json").write_text(json.dumps({"text": "a", "n": [1, 2]}, indent=2))  # one document, pretty
    with pytest.raises(
        DataError,
        match=r"meta\.json:1: not valid JSON \(.*\); a file of JSON lines holds one "
        r"object per line, and this looks like one JSON document",
    ):
        prepare([str(tmp_path / "meta.json")], tmp_path / "out", progress=False)


def test_parquet_without_the_column(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet has no column 'text' \(columns: \['body'\]\); pass --field"):
        prepare([str(tmp_path / "p.parquet")], tmp_path / "out", progress=False)


def test_too_little_data_for_the_batch(tmp_path):
    root = write_bytes_dataset(tmp_path / "tiny", [b"short document"])
    with pytest.raises(DataError, match=r"tiny: .* too few"):
        build_loaders(job(root), None)
