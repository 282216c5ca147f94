"""`megascale prep` on inputs made by other tools: compressed files, Parquet, `datasets` Arrow
directories, globs, fsspec URLs; compared with the tokenizers library encoding each document."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import subprocess
import sys
from pathlib import Path

import datasets
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megascale.data import DataError
from megascale.data.prep import Options, prepare
from tests.data.conftest import bpe_tokenizer, library_encoding, make_docs, wordpiece_tokenizer, written_documents

COMPRESS = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "zst": lambda data: zstandard.ZstdCompressor().compress(data),
}


def jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)).encode()


def mixed_inputs(root: Path) -> tuple[list[str], list[str]]:
    """(prep's arguments, every document in the order prep must write them)."""
    docs = [d.decode() for d in make_docs(180, seed=11)]
    parts = [docs[i::9] for i in range(9)]
    corpus = root / "corpus"
    (corpus / "c-hf").mkdir(parents=True)
    (corpus / "a-plain.jsonl").write_bytes(jsonl(parts[0]))
    (corpus / "b-text.txt").write_text(parts[1][0])
    pq.write_table(
        pa.table({"text": parts[2], "id": list(range(len(parts[2])))}), corpus / "b-table.parquet", row_group_size=3
    )
    datasets.Dataset.from_dict({"text": parts[3]}).save_to_disk(str(corpus / "c-hf"))
    for name, compress, part in [
        ("d.jsonl.gz", "gz", parts[4]),
        ("e.jsonl.zst", "zst", parts[5]),
        ("f.json.bz2", "bz2", parts[6]),
        ("g.ndjson.xz", "xz", parts[7]),
    ]:
        (corpus / name).write_bytes(COMPRESS[compress](jsonl(part)))
    (corpus / "h.txt.gz").write_bytes(gzip.compress(parts[1][1].encode()))
    (corpus / "README").write_text("not data")  # no known suffix: left out, and counted
    memory = fsspec.filesystem("memory")
    memory.pipe("/prep-test/m.jsonl.zst", COMPRESS["zst"](jsonl(parts[8][:10])))
    memory.pipe("/prep-test/n.parquet", _parquet_bytes(parts[8][10:]))
    (root / "glob-1.jsonl").write_bytes(jsonl(parts[0][:3]))
    expected = (
        parts[0]
        + parts[2]
        + [parts[1][0]]
        + parts[3]
        + parts[4]
        + parts[5]
        + parts[6]
        + parts[7]
        + [parts[1][1]]
        + parts[8]
        + parts[0][:3]
        + parts[0]
    )
    args = [str(corpus), "memory://prep-test/*", str(root / "glob-*.jsonl"), f"file://{corpus / 'a-plain.jsonl'}"]
    return args, expected


def _parquet_bytes(docs: list[str]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": docs}), sink, row_group_size=4)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("kind", ["bytes", "bpe", "wordpiece"])
def test_mixed_inputs_round_trip(tmp_path, kind):
    args, docs = mixed_inputs(tmp_path)
    if kind == "bytes":
        spec, want = "bytes", [list(d.encode()) for d in docs]
    else:
        tok = (bpe_tokenizer if kind == "bpe" else wordpiece_tokenizer)(docs)
        tok.save(str(tmp_path / f"{kind}.json"))
        spec, want = str(tmp_path / f"{kind}.json"), library_encoding(tok, docs)
    manifest = prepare(args, tmp_path / "out", spec, progress=False, chunk_bytes=600)
    assert written_documents(tmp_path / "out") == want
    counts = manifest["counts"]
    assert counts["documents_in"] == counts["documents"] == len(docs)
    assert counts["tokens_in"] == sum(map(len, want))
    stored = sum(
        p.stat().st_size
        for p in (tmp_path / "corpus").rglob("*")
        if p.is_file() and p.name != "README" and p.suffix != ".json"
    )
    stored += (tmp_path / "glob-1.jsonl").stat().st_size + (tmp_path / "corpus" / "a-plain.jsonl").stat().st_size
    stored += sum(fsspec.filesystem("memory").size(p) for p in ("/prep-test/m.jsonl.zst", "/prep-test/n.parquet"))
    assert counts["bytes_read"] == stored
    assert manifest["source"]["ignored_files"] == 1 and manifest["source"]["files"] == 13
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out-")]  # no temporary or spill left


def test_one_and_two_workers_write_identical_output(tmp_path):
    """Different worker counts and task sizes: the same shards and the same manifest, byte for byte."""
    args, docs = mixed_inputs(tmp_path)
    bpe_tokenizer(docs).save(str(tmp_path / "bpe.json"))
    spec = str(tmp_path / "bpe.json")
    prepare(args, tmp_path / "one", spec, workers=1, shard_tokens=700, progress=False)
    prepare(args, tmp_path / "two", spec, workers=2, shard_tokens=700, progress=False, chunk_bytes=400)
    one, two = sorted((tmp_path / "one").iterdir()), sorted((tmp_path / "two").iterdir())
    assert [p.name for p in one] == [p.name for p in two] and len(one) > 4
    for a, b in zip(one, two, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_lines_format_and_explicit_formats(tmp_path):
    (tmp_path / "corpus.txt").write_bytes(b"first doc\n\nsecond doc\r\nthird\n")
    prepare([str(tmp_path / "corpus.txt")], tmp_path / "out", options=Options(kind="lines"), progress=False)
    got = written_documents(tmp_path / "out")
    assert [bytes(d) for d in got] == [b"first doc", b"second doc", b"third"]
    (tmp_path / "data.log").write_text("x")
    with pytest.raises(DataError, match=r"cannot tell the format of .*data\.log from its name; pass --format"):
        prepare([str(tmp_path / "data.log")], tmp_path / "o2", progress=False)
    prepare([str(tmp_path / "data.log")], tmp_path / "o2", options=Options(kind="text"), progress=False)


def test_datasets_dict_directory_asks_for_a_split(tmp_path):
    split = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        DataError,
        match=r"dd is a Hugging Face DatasetDict with splits \['train', 'test'\]; "
        r"pass one split's directory, e.g. .*dd/train",
    ):
        prepare([str(tmp_path / "dd")], tmp_path / "out", progress=False)
    prepare([str(tmp_path / "dd" / "train")], tmp_path / "out", progress=False)
    assert [bytes(d) for d in written_documents(tmp_path / "out")] == [b"a", b"b"]


def test_prep_does_not_import_torch(tmp_path):
    """prep and its workers (which import the same modules) start without torch."""
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    code = (
        "import sys; from megascale.cli import main; "
        f"rc = main(['prep', {str(tmp_path / 'a.jsonl')!r}, '--out', {str(tmp_path / 'out')!r}, '--quiet']); "
        "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pyarrow', 'fsspec')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "0 []"


def test_pandas_categorical_parquet_column_is_read_as_its_values(tmp_path):
    import pandas as pd

    docs = ["alpha beta", "gamma", "alpha beta", "delta epsilon", "gamma"]
    frame = pd.DataFrame({"text": pd.Categorical(docs), "n": range(len(docs))})
    frame.to_parquet(tmp_path / "cat.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "cat.parquet").field("text").type)
    prepare([str(tmp_path / "cat.parquet")], tmp_path / "out", progress=False)
    assert [bytes(d) for d in written_documents(tmp_path / "out")] == [d.encode() for d in docs]


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-16-be"])
@pytest.mark.parametrize("compressed", [False, True])
def test_utf16_jsonl_is_refused_by_name(tmp_path, codec, compressed):
    """PowerShell's `Out-File` writes UTF-16 with a byte-order mark; `-le`/`-be` have none."""
    text = "".join(json.dumps({"text": f"line {i} é"}) + "\r\n" for i in range(50)).encode(codec)
    path = tmp_path / ("w.jsonl.gz" if compressed else "w.jsonl")
    path.write_bytes(gzip.compress(text) if compressed else text)
    with pytest.raises(
        DataError,
        match=r"w\.jsonl(\.gz)? is UTF-16 (little|big)-endian text .* not UTF-8; "
        r"convert it first, e\.g\. `iconv -f UTF-16 -t UTF-8",
    ):
        prepare([str(path)], tmp_path / "out", progress=False)
    manifest = prepare(
        [str(path), str(_utf8_file(tmp_path))], tmp_path / "out", progress=False, options=Options(on_error="skip")
    )
    assert manifest["counts"]["skipped"] == {"UTF-16": 1} and manifest["documents"] == 1


def _utf8_file(tmp_path: Path) -> Path:
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n")
    return path


def test_prepared_directory_follows_the_umask(tmp_path):
    import os

    (tmp_path / "a.txt").write_text("shared with the team\n")
    old = os.umask(0o022)
    try:
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", progress=False)
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in (tmp_path / "out").iterdir())
