"""One long text document in bounded pieces: the tokens of the whole document, as the library
encodes it, for tokenizers in the style of Llama 3 (byte-level BPE with its split pattern),
Mistral (SentencePiece-style Metaspace) and byte-level; the pieces really are cut (most
boundaries find a safe cut) and spread over workers (two workers write the same bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from megascale.data.inputs import find_inputs
from megascale.data.pieces import Cutter
from megascale.data.prep import prepare
from megascale.data.tasks import plan
from megascale.data.tokenizer import load_tokenizer
from tests.data.conftest import written_documents
from tests.data.families import build, corpus

CHUNK = 16 << 10


def _long_document(path: Path, size: int = 400 << 10) -> Path:
    """Lines of words, runs of spaces and blank lines, and a few long lines with no break."""
    lines = corpus(300)
    parts, total, i = [], 0, 0
    while total < size:
        line = lines[i % len(lines)] + ("   indented  " if i % 5 == 0 else "") + ("\n\n" if i % 9 == 0 else "\n")
        if i % 97 == 0:
            line = "x" * 9000 + "\n"  # longer than the search window: no cut inside it
        parts.append(line)
        total += len(line.encode())
        i += 1
    path.write_text("".join(parts), encoding="utf-8")
    return path


@pytest.mark.parametrize("family", ["llama3", "mistral", "bytes"])
def test_pieces_give_the_tokens_of_the_whole_document(family: str, tmp_path: Path) -> None:
    doc = _long_document(tmp_path / "book.txt")
    spec = "bytes" if family == "bytes" else str(build(family, tmp_path / family) / "tokenizer.json")
    tok = load_tokenizer(spec)
    tasks = list(plan(find_inputs([str(doc)]).files, "text", CHUNK, str(tmp_path)))
    assert len(tasks) > 20 and all(t.piece == CHUNK for t in tasks)
    cutter = Cutter(str(doc), doc.stat().st_size, lambda texts: [tok.encode(t.encode()) for t in texts], tok.takes_text)
    cuts = [cutter.cut(t.start, CHUNK) for t in tasks[1:]]
    assert sum(c is not None for c in cuts) >= 0.8 * len(cuts)  # most boundaries are cut

    prepare([str(doc)], tmp_path / "one", spec, workers=1, progress=False, chunk_bytes=CHUNK)
    text = doc.read_bytes()
    if family == "bytes":
        want = list(text)
    else:
        library = Tokenizer.from_file(spec)
        want = library.encode(text.decode(), add_special_tokens=True).ids
    assert written_documents(tmp_path / "one") == [want]

    prepare([str(doc)], tmp_path / "two", spec, workers=2, progress=False, chunk_bytes=CHUNK)
    assert [p.read_bytes() for p in sorted((tmp_path / "two").glob("shard_*"))] == [
        p.read_bytes() for p in sorted((tmp_path / "one").glob("shard_*"))
    ]
