"""The worker's side of `prep`: one task's records read, checked, encoded in batches, packed.

Every unit a task covers (a line, a row, a text file) ends up in exactly one count: a written
document, an empty one, a blank line, or a rejected record with its reason and place in the
task; the parent adds the counts up and checks that nothing went missing. Encoding goes through
the tokenizer's batch call, a megabyte of text at a time, in one thread per worker.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from megascale.data.pieces import Cutter
from megascale.data.shards import dtype_for_vocab, with_eod
from megascale.data.tasks import Task, open_arrow
from megascale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

BATCH_CHARS = 1 << 20  # text encoded per call of the tokenizer's batch API
ROWS_PER_BATCH = 8192
_replaced = [0]  # bytes / code points replaced by U+FFFD since the counter was last read


def _count_and_replace(exc: UnicodeError) -> tuple[str | bytes, int]:
    _replaced[0] += exc.end - exc.start  # type: ignore[attr-defined]
    if isinstance(exc, UnicodeEncodeError):  # an encoder takes only ASCII str, or bytes
        return "\ufffd".encode(), exc.end
    return "\ufffd", exc.end  # type: ignore[attr-defined]


codecs.register_error("megascale.replace", _count_and_replace)


@dataclass(frozen=True)
class Job:
    """What every worker needs: how to read the records and which tokenizer encodes them."""

    tokenizer: str
    field: str = "text"
    replace_invalid: bool = False  # invalid UTF-8 / lone surrogates -> U+FFFD (counted) instead of a reject
    eod_token: str | None = None  # the user's end-of-document token (None: the tokenizer's own)
    bos: str | None = None  # the user's BOS token, or "none" (None: the tokenizer's own)


@dataclass
class Reject:
    unit: int  # line / row index within the task (0 for a text file or an unreadable input)
    reason: str  # the count's key in the manifest
    detail: str


@dataclass
class TaskResult:
    size: int  # stored input bytes the task accounts for
    units: int = 0  # lines (JSON lines, text lines) or rows the task covered
    documents_in: int = 0  # records found (blank lines are not records)
    blank_lines: int = 0
    empty: int = 0  # documents with no text
    no_tokens: int = 0  # documents with text that the tokenizer turned into no tokens
    replaced: int = 0  # invalid bytes or lone surrogates replaced by U+FFFD
    eod_inside: int = 0  # end-of-document ids the tokenizer produced inside documents
    tokens_in: int = 0  # tokens the tokenizer produced for the written documents, BOS included
    continues: bool = False  # a piece of a long document that the next task goes on with (no EOD yet)
    packed: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint16))
    lengths: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # EOD included
    rejects: list[Reject] = field(default_factory=list)


class Encoder:
    """Turns one task into a TaskResult with this process's tokenizer."""

    def __init__(self, job: Job, tok: ByteTokenizer | HFTokenizer | None = None):
        """`tok`: the job's tokenizer, already loaded (prep with one worker: not loaded twice)."""
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; workers are the parallelism
        self.job = job
        self.tok: ByteTokenizer | HFTokenizer = tok or load_tokenizer(job.tokenizer, job.eod_token, job.bos)
        self.dtype = dtype_for_vocab(self.tok.vocab_size)

    def __call__(self, task: Task) -> TaskResult:
        result = TaskResult(task.size)
        if task.failure is not None:
            result.documents_in = 1  # the unreadable rest of the file counts as one record
            result.rejects.append(Reject(0, task.failure_kind, task.failure))
            return result
        _replaced[0] = 0
        if task.piece:
            self._encode_piece(task, result)
            result.replaced = _replaced[0]
            return result
        docs: list = []
        units: list[int] = []
        for unit, value in self.records(task, result):
            if not value:
                result.empty += 1
                continue
            doc = self._convert(value, unit, result)
            if doc is not None:
                docs.append(doc)
                units.append(unit)
        self._encode(docs, units, result)
        result.rejects.sort(key=lambda r: r.unit)
        result.replaced = _replaced[0]
        return result

    # -- reading ----------------------------------------------------------------------------
    def records(self, task: Task, result: TaskResult) -> Iterator[tuple[int, str | bytes]]:
        """(unit, document) of every record; blank lines and bad records are counted in `result`."""
        kind = task.file.kind
        if kind in ("parquet", "arrow"):
            yield from self._rows(task, result)
            return
        data = task.payload if task.payload is not None else _read_range(task)
        if kind == "text":
            result.units = result.documents_in = 1
            yield 0, data
            return
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        result.units = len(lines)
        for unit, line in enumerate(lines):
            if not line.strip():
                result.blank_lines += 1
                continue
            result.documents_in += 1
            if kind == "lines":
                yield unit, line.removesuffix(b"\r")
            else:
                value = self._json_field(line, unit, task, result)
                if value is not None:
                    yield unit, value

    def _json_field(self, line: bytes, unit: int, task: Task, result: TaskResult) -> str | None:
        name = self.job.field
        try:
            record = json.loads(line)
        except UnicodeDecodeError as exc:
            if not self.job.replace_invalid:
                result.rejects.append(
                    Reject(
                        unit,
                        "invalid UTF-8",
                        f"invalid UTF-8 at byte {exc.start} of the line "
                        f"(pass --replace-invalid to replace it with U+FFFD)",
                    )
                )
                return None
            return self._json_field(line.decode("utf-8", "megascale.replace").encode(), unit, task, result)
        except json.JSONDecodeError as exc:
            hint = ""
            if task.start == 0 and unit == 0 and (line.lstrip().startswith(b"[") or line.strip() == b"{"):
                hint = (
                    "; a file of JSON lines holds one object per line, and this looks like one JSON "
                    "document spread over lines: give prep the .jsonl files only"
                )
            result.rejects.append(Reject(unit, "invalid JSON", f"not valid JSON ({exc.msg}){hint}"))
            return None
        if not isinstance(record, dict):
            result.rejects.append(
                Reject(
                    unit, "not a JSON object", f"a JSON {type(record).__name__}, not an object with a {name!r} field"
                )
            )
            return None
        if name not in record:
            result.rejects.append(Reject(unit, "missing field", f"no field {name!r} in this record (use --field NAME)"))
            return None
        value = record[name]
        if value is None:
            result.rejects.append(Reject(unit, "null", f"field {name!r} is null"))
            return None
        if not isinstance(value, str):
            kind = type(value).__name__
            result.rejects.append(Reject(unit, "not a string", f"field {name!r} is {kind}, not a string"))
            return None
        return value

    def _rows(self, task: Task, result: TaskResult) -> Iterator[tuple[int, bytes]]:
        import pyarrow as pa

        unit = 0
        try:
            for batch in _row_batches(task, self.job.field):
                column = batch.column(batch.schema.get_field_index(self.job.field))
                if pa.types.is_dictionary(column.type):  # a Categorical column: its values, row by row
                    column = column.dictionary_decode()
                column = column.cast(pa.large_binary())
                for value in column.to_pylist():
                    result.documents_in += 1
                    if value is None:
                        result.rejects.append(Reject(unit, "null", f"column {self.job.field!r} is null"))
                    else:
                        yield unit, value
                    unit += 1
        except (OSError, pa.ArrowException) as exc:  # damaged pages: the rest of the task is lost, and counted
            result.documents_in += 1
            result.rejects.append(Reject(unit, "unreadable", f"cannot read rows from here on: {exc}"))
        result.units = unit

    # -- checking and encoding --------------------------------------------------------------
    def _convert(self, value: str | bytes, unit: int, result: TaskResult) -> str | bytes | None:
        """The document in the form the tokenizer takes: bytes (byte-level) or str (HF)."""
        if isinstance(value, str):
            return value if self.tok.takes_text else self._utf8(value, unit, result)
        if not self.tok.takes_text:
            return value
        try:
            return value.decode()
        except UnicodeDecodeError as exc:
            if self.job.replace_invalid:
                return value.decode("utf-8", "megascale.replace")
            line = value.count(b"\n", 0, exc.start) + 1
            result.rejects.append(
                Reject(
                    unit,
                    "invalid UTF-8",
                    f"invalid UTF-8 at byte {exc.start} (line {line} of "
                    f"the document); pass --replace-invalid to replace it with U+FFFD",
                )
            )
            return None

    def _utf8(self, text: str, unit: int, result: TaskResult) -> bytes | None:
        try:
            return text.encode()
        except UnicodeEncodeError as exc:
            if self.job.replace_invalid:
                return text.encode("utf-8", "megascale.replace")
            result.rejects.append(
                Reject(
                    unit,
                    "lone surrogate",
                    f"lone surrogate {text[exc.start]!r} at character "
                    f"{exc.start}: not valid Unicode text (pass --replace-invalid to replace "
                    f"it with U+FFFD)",
                )
            )
            return None

    def _encode(self, docs: list, units: list[int], result: TaskResult) -> None:
        ids_parts, length_parts = [], []
        start = size = 0
        for i, doc in enumerate(docs):
            size += len(doc)
            if size >= BATCH_CHARS or i == len(docs) - 1:
                ids, lengths = self._encode_batch(docs[start : i + 1], units[start : i + 1], result)
                ids_parts.append(ids)
                length_parts.append(lengths)
                start, size = i + 1, 0
        if not ids_parts:
            return
        ids, lengths = np.concatenate(ids_parts), np.concatenate(length_parts)
        result.eod_inside = int(np.count_nonzero(ids == self.tok.eod)) if self.tok.takes_text else 0
        result.no_tokens = int(np.count_nonzero(lengths == 0))
        lengths = lengths[lengths > 0]
        bos = self.tok.bos
        result.tokens_in = len(ids) + (0 if bos is None else len(lengths))
        result.packed = with_eod(ids, lengths, self.tok.eod, self.dtype, bos)
        result.lengths = lengths + (1 if bos is None else 2)

    def _encode_piece(self, task: Task, result: TaskResult) -> None:
        """One piece of a long text document: BOS before the first, EOD after the last; a piece
        that is not valid text is a record of its own, rejected (the document goes on)."""
        assert task.file.path is not None
        first, last = task.start == 0, task.stop >= task.file.size
        result.units = result.documents_in = int(first)
        result.continues = not last
        cutter = Cutter(task.file.path, task.file.size, self._encode_texts, self.tok.takes_text)
        bounds = cutter.bounds(task.start, task.piece)
        ids = np.empty(0, np.int64)
        if bounds is not None:
            with open(task.file.path, "rb") as f:
                f.seek(bounds[0])
                data = f.read(bounds[1] - bounds[0])
            doc = self._convert(data, 0, result) if data else None
            if doc is None and data:
                result.documents_in += 1  # the rejected piece, counted as a record
            elif doc is not None:
                ids = self.tok.encode_batch([doc])[0]
        bos = [self.tok.bos] if first and self.tok.bos is not None else []
        eod = [self.tok.eod] if last else []
        result.tokens_in = len(ids) + len(bos)
        result.eod_inside = int(np.count_nonzero(ids == self.tok.eod)) if self.tok.takes_text else 0
        result.packed = np.concatenate([np.asarray(bos, np.int64), ids, np.asarray(eod, np.int64)]).astype(self.dtype)
        result.lengths = np.empty(0, np.int64)
        if last:  # the document ends here: its length counts from this task's tokens on (the writer has the rest)
            result.lengths = np.array([len(result.packed)], np.int64)

    def _encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        ids, lengths = self.tok.encode_batch(texts)
        return np.split(ids, np.cumsum(lengths)[:-1])

    def _encode_batch(self, docs: list, units: list[int], result: TaskResult) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self.tok.encode_batch(docs)
        except TypeError:  # the library refuses a str holding a lone surrogate: find it
            kept = []
            for unit, doc in zip(units, docs, strict=True):
                if not _has_surrogate(doc):
                    kept.append(doc)
                elif (fixed := self._utf8(doc, unit, result)) is not None:  # replaced, or rejected
                    kept.append(fixed.decode())
            return self.tok.encode_batch(kept) if kept else (np.empty(0, np.int64), np.empty(0, np.int64))


def _has_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _read_range(task: Task) -> bytes:
    assert task.file.path is not None
    with open(task.file.path, "rb") as f:
        f.seek(task.start)
        return f.read(task.stop - task.start)


def _row_batches(task: Task, field: str) -> Iterator:
    if task.file.kind == "parquet":
        import pyarrow.parquet as pq

        file = pq.ParquetFile(task.file.path)
        yield from file.iter_batches(ROWS_PER_BATCH, row_groups=range(task.start, task.stop), columns=[field])
        return
    reader = open_arrow(task.file.path)
    if hasattr(reader, "num_record_batches"):
        for i in range(task.start, task.stop):
            yield reader.get_batch(i)
        return
    for i, batch in enumerate(reader):  # a stream has no index: skip to the task's batches (zero-copy)
        if i >= task.stop:
            return
        if i >= task.start:
            yield batch
