"""Bad records stop `prep` with their place (exit 2, nothing written), or with --on-error=skip are
counted and listed while every good document comes out exactly as from a clean input."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megascale.cli import main
from megascale.data import DataError
from megascale.data.ledger import LostData
from megascale.data.prep import Options, prepare
from megascale.data.shards import ShardWriter
from tests.data.conftest import bpe_tokenizer, library_encoding, make_docs, written_documents

SKIP = Options(on_error="skip")
# (bad JSON line, reason counted with --on-error=skip, the error's text after "FILE:LINE: ")
BAD_LINES = {
    "invalid JSON": (b'{"text": "a"', "invalid JSON", r"not valid JSON \(Expecting ',' delimiter\)"),
    "invalid UTF-8": (b'{"text": "caf\xe9"}', "invalid UTF-8", r"invalid UTF-8 at byte 13 of the line"),
    "lone surrogate": (b'{"text": "a\\ud800b"}', "lone surrogate", r"lone surrogate '\\ud800' at character 1"),
    "missing field": (b'{"body": "x"}', "missing field", r"no field 'text' in this record \(use --field NAME\)"),
    "null": (b'{"text": null}', "null", r"field 'text' is null"),
    "number": (b'{"text": 7}', "not a string", r"field 'text' is int, not a string"),
    "array": (b'["text"]', "not a JSON object", r"a JSON list, not an object with a 'text' field"),
}


def good_lines(n: int = 12) -> list[bytes]:
    return [json.dumps({"text": d.decode()}).encode() for d in make_docs(n, seed=8)]


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".out"))


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    bpe_tokenizer([d.decode() for d in make_docs(40)]).save(str(path))
    return str(path)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_jsonl_record_stops_or_is_skipped(tmp_path, case, tokenizer, bpe_file, capsys):
    spec = bpe_file if tokenizer == "bpe" else "bytes"
    bad, reason, message = BAD_LINES[case]
    lines = good_lines()
    (tmp_path / "clean.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"\n".join(lines[:5] + [b""] + [bad] + lines[5:]) + b"\n")  # the bad record is line 7
    with pytest.raises(DataError, match=rf"c\.jsonl:7: {message}"):
        prepare([str(path)], tmp_path / "out", spec, progress=False, chunk_bytes=300)
    assert main(["prep", str(path), "--out", str(tmp_path / "out"), "--tokenizer", spec, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "c.jsonl:7: " in err and "--on-error=skip" in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []

    clean = prepare([str(tmp_path / "clean.jsonl")], tmp_path / "clean", spec, progress=False)
    skipped = prepare([str(path)], tmp_path / "out", spec, options=SKIP, progress=False, chunk_bytes=300)
    assert skipped["counts"]["skipped"] == {reason: 1}
    assert skipped["counts"]["documents_in"] == 13 and skipped["documents"] == 12
    assert skipped["counts"]["blank_lines"] == 1
    assert [s["sha256"] for s in skipped["shards"]] == [s["sha256"] for s in clean["shards"]]
    rejected = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in rejected] == [(str(path), 7, reason)]


def test_replace_invalid_counts_what_it_replaced(tmp_path, bpe_file):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "caf\xe9 \xff"}\n{"text": "a\\ud800b"}\n')
    manifest = prepare([str(path)], tmp_path / "out", bpe_file, options=Options(replace_invalid=True), progress=False)
    assert manifest["counts"]["replaced_invalid"] == 3 and manifest["counts"]["skipped"] == {}
    tok = bpe_tokenizer([d.decode() for d in make_docs(40)])
    assert written_documents(tmp_path / "out") == library_encoding(tok, ["caf\ufffd \ufffd", "a\ufffdb"])


def test_text_file_with_invalid_utf8(tmp_path, bpe_file):
    raw = b"line one\nline tw\xc3o\n"
    (tmp_path / "t.txt").write_bytes(raw)
    # byte-level keeps every byte: nothing to report
    prepare([str(tmp_path / "t.txt")], tmp_path / "bytes", progress=False)
    assert written_documents(tmp_path / "bytes") == [list(raw)]
    with pytest.raises(
        DataError,
        match=r"t\.txt: invalid UTF-8 at byte 16 \(line 2 of the document\); "
        r"pass --replace-invalid",
    ):
        prepare([str(tmp_path / "t.txt")], tmp_path / "out", bpe_file, progress=False)
    manifest = prepare(
        [str(tmp_path / "t.txt")], tmp_path / "out", bpe_file, options=Options(replace_invalid=True), progress=False
    )
    assert manifest["counts"]["replaced_invalid"] == 1


def test_parquet_null_is_reported_by_global_row(tmp_path):
    docs: list[str | None] = [f"row {i}" for i in range(14)]
    docs[9] = None
    pq.write_table(pa.table({"text": docs}), tmp_path / "p.parquet", row_group_size=4)
    with pytest.raises(DataError, match=r"p\.parquet: row 9: column 'text' is null"):
        prepare([str(tmp_path / "p.parquet")], tmp_path / "out", progress=False)
    manifest = prepare([str(tmp_path / "p.parquet")], tmp_path / "out", options=SKIP, progress=False, chunk_bytes=1)
    assert manifest["counts"]["skipped"] == {"null": 1} and manifest["documents"] == 13
    rejected = json.loads((tmp_path / "out" / "rejected.jsonl").read_text())
    assert rejected["row"] == 9 and rejected["reason"] == "null"


@pytest.mark.parametrize("suffix", ["gz", "zst"])
@pytest.mark.parametrize("chunk", [4096, 0])  # several tasks before the cut, or all of it in the last one
def test_truncated_compressed_file(tmp_path, suffix, chunk):
    lines = b"\n".join(good_lines(2500)) + b"\n"  # several zstd blocks
    packed = gzip.compress(lines) if suffix == "gz" else zstandard.ZstdCompressor().compress(lines)
    path = tmp_path / f"c.jsonl.{suffix}"
    path.write_bytes(packed[: len(packed) * 3 // 4])
    codec = "gzip" if suffix == "gz" else "zstd"
    with pytest.raises(
        DataError,
        match=rf"c\.jsonl\.{suffix}:\d+: truncated file: its {codec} data ends "
        rf"before the end of the stream",
    ):
        prepare([str(path)], tmp_path / "out", progress=False, chunk_bytes=chunk)
    manifest = prepare([str(path)], tmp_path / "out", options=SKIP, progress=False, chunk_bytes=chunk)
    assert manifest["counts"]["skipped"] == {"truncated": 1}
    assert manifest["counts"]["bytes_read"] == path.stat().st_size
    if suffix == "gz":  # every whole line that zlib can decode from the cut file is kept
        decodable = zlib.decompressobj(wbits=31).decompress(path.read_bytes())
        assert manifest["documents"] == decodable.count(b"\n") > 1000
    assert 1000 < manifest["documents"] < 2500


def test_malformed_tokenizer_file_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    for name, content in [("cut.json", '{"version": "1.0", "model": {'), ("vocab.json", '{"a": 1, "b": 2}')]:
        (tmp_path / name).write_text(content)
        with pytest.raises(
            DataError,
            match=rf"tokenizer file .*{name} is not a tokenizer\.json the tokenizers "
            r"library can load \(.+\); pass the tokenizer\.json saved by",
        ):
            prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", str(tmp_path / name), progress=False)
    assert leftovers(tmp_path) == []


def test_counts_that_do_not_add_up_stop_the_run(tmp_path, monkeypatch):
    """The invariant is checked on every run: a writer that drops a document is caught."""
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(good_lines()) + b"\n")
    original = ShardWriter.add_packed

    def drop_last_document(self, packed, lengths):
        original(self, packed[: len(packed) - int(lengths[-1])], lengths[:-1])

    monkeypatch.setattr(ShardWriter, "add_packed", drop_last_document)
    with pytest.raises(LostData, match=r"12 tokens? encoded|documents written"):
        prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
