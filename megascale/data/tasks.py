"""Input files cut into tasks that workers tokenise independently, so one file feeds every core.

A local uncompressed file is cut without reading it: line-aligned byte ranges of JSON lines or
text lines, groups of Parquet row groups, groups of Arrow record batches, and a long text
document into pieces that workers cut at safe boundaries (pieces.py). A compressed or remote
file cannot be entered in the middle, so the parent reads it once as a stream and hands out its
decompressed text in line-aligned chunks; a compressed or remote Parquet or Arrow file is first
copied (decompressed) into a local spill file. Each task also carries the share of the stored
bytes it accounts for, so the progress bar has a total and every input byte is counted once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace

from megascale.data.inputs import InputFile
from megascale.data.shards import DataError

READ_BLOCK = 1 << 20
PIECE_MAX = 256 << 10  # bytes of a long text document tokenised at a time (pieces.py)
TEXT_TYPES = ("string", "large_string", "binary", "large_binary", "string_view", "binary_view")


@dataclass(frozen=True)
class Task:
    file: InputFile
    index: int  # the file's position among the inputs (lines and rows are numbered per file)
    size: int  # stored bytes of the input this task accounts for
    start: int = 0  # byte offset; first row group / record batch
    stop: int = 0  # end byte offset; end row group / record batch
    payload: bytes | None = None  # the text itself, read by the parent (compressed or remote input)
    failure: str | None = None  # the input could not be read from here on: why
    failure_kind: str = "unreadable"  # the count's key: unreadable | truncated | UTF-16
    piece: int = 0  # > 0: this task is bytes start..stop of one long text document cut in pieces of this size


def plan(files: list[InputFile], field: str, chunk: int, spill_dir: str) -> Iterator[Task]:
    """Every file's tasks in input order. Lazy: a stream is read only as tasks are taken."""
    for index, file in enumerate(files):
        if file.kind in ("parquet", "arrow"):
            yield from _tabular(file, index, field, chunk, spill_dir)
        elif file.splittable and (utf16 := utf16_failure(file, _head(file))):
            yield Task(file, index, file.size, failure=utf16, failure_kind="UTF-16")
        elif file.splittable and file.kind == "text" and file.size > (piece := min(chunk, PIECE_MAX)):
            yield from (
                Task(
                    file,
                    index,
                    min(start + piece, file.size) - start,
                    start,
                    min(start + piece, file.size),
                    piece=piece,
                )
                for start in range(0, file.size, piece)
            )
        elif file.splittable and file.kind == "text":
            yield Task(file, index, file.size, 0, file.size)
        elif file.splittable:
            yield from _line_ranges(file, index, chunk)
        else:
            yield from _streamed(file, index, chunk)


UTF16_BOMS = {b"\xff\xfe": "UTF-16 little-endian", b"\xfe\xff": "UTF-16 big-endian"}


def utf16_failure(file: InputFile, head: bytes) -> str | None:
    """Why a file whose first bytes are `head` is UTF-16 text (a byte-order mark, or every other
    byte NUL), which prep does not read; None for any other file."""
    kind = UTF16_BOMS.get(head[:2])
    sample = head[:64]
    if kind is None and len(sample) >= 8 and sample.count(0) * 2 >= len(sample) - 1:
        kind = "UTF-16 little-endian" if sample[1::2].count(0) > sample[::2].count(0) else "UTF-16 big-endian"
    if kind is None:
        return None
    return (
        f"{file.name} is {kind} text (as PowerShell and some Windows tools write it), not UTF-8; "
        f"convert it first, e.g. `iconv -f UTF-16 -t UTF-8 IN > OUT`"
    )


def _head(file: InputFile) -> bytes:
    assert file.path is not None
    with open(file.path, "rb") as f:
        return f.read(64)


def _line_ranges(file: InputFile, index: int, chunk: int) -> Iterator[Task]:
    """Byte ranges of about `chunk` that start and end at line boundaries."""
    assert file.path is not None
    with open(file.path, "rb") as f:
        start = 0
        while start < file.size:
            f.seek(min(start + chunk, file.size))
            f.readline()
            end = min(f.tell(), file.size)
            yield Task(file, index, end - start, start, end)
            start = end


def _streamed(file: InputFile, index: int, chunk: int) -> Iterator[Task]:
    """Chunks of whole lines (or, for a text document, all of it) read through the decompressor.
    Damaged or truncated data ends the file with a failure task, after the whole lines before it."""
    counted = 0  # stored bytes accounted for by the tasks handed out so far
    carry, first = b"", True
    raw = file.open_raw()
    try:
        for block in decompressed(raw, file):
            if first and (utf16 := utf16_failure(file, block[:64])):
                yield Task(file, index, file.size, failure=utf16, failure_kind="UTF-16")
                return
            first = False
            carry += block
            if file.kind == "text" or len(carry) < chunk:
                continue
            cut = carry.rfind(b"\n") + 1
            if cut:
                position = raw.tell()
                yield Task(file, index, position - counted, payload=carry[:cut])
                counted, carry = position, carry[cut:]
    except DataError as exc:
        cut = carry.rfind(b"\n") + 1 if file.kind != "text" else 0
        if cut:  # the records before the damage are kept; they account for none of the stored bytes
            yield Task(file, index, 0, payload=carry[:cut])
        kind = "truncated" if isinstance(exc.__cause__, EOFError) else "unreadable"
        yield Task(file, index, file.size - counted, failure=str(exc), failure_kind=kind)
        return
    finally:
        raw.close()
    yield Task(file, index, file.size - counted, payload=carry)


def decompressed(raw, file: InputFile) -> Iterator[bytes]:
    """Blocks of the file's content; damaged or truncated compressed data raises DataError."""
    try:
        if file.compression is None:
            yield from iter(lambda: raw.read(READ_BLOCK), b"")
        elif file.compression == "zstd":
            yield from _zstd_blocks(raw)
        else:
            stream = _stdlib_stream(raw, file.compression)  # read1: what came before damage is kept
            yield from iter(lambda: stream.read1(READ_BLOCK), b"")
    except EOFError as exc:
        raise DataError(
            f"truncated file: its {file.compression} data ends before the end of the stream ({exc}); "
            f"with --on-error=skip the whole records before the cut are kept"
        ) from exc
    except Exception as exc:  # each codec has its own error classes (OSError, LZMAError...)
        raise DataError(f"cannot read the {file.compression or 'stored'} data: {exc}") from exc


def _stdlib_stream(raw, compression: str):
    if compression == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=raw)
    if compression == "bz2":
        import bz2

        return bz2.BZ2File(raw)
    import lzma

    return lzma.LZMAFile(raw)


def _zstd_blocks(raw) -> Iterator[bytes]:
    """zstd frames one after another. zstandard's stream_reader returns nothing, without an
    error, for a truncated frame; a decompressobj tells us whether the last frame ended."""
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - in the test extra
        raise ImportError("reading .zst files needs zstandard (pip install 'megascale[zstd]')") from exc
    frame, started = zstandard.ZstdDecompressor().decompressobj(), False
    while data := raw.read(READ_BLOCK):
        while data:
            out = frame.decompress(data)
            started = True
            if out:
                yield out
            data = b""
            if frame.eof:
                data = frame.unused_data
                frame, started = zstandard.ZstdDecompressor().decompressobj(), False
    if started:
        raise EOFError("zstd data ended before the end of its frame (truncated file)")


def _tabular(file: InputFile, index: int, field: str, chunk: int, spill_dir: str) -> Iterator[Task]:
    """Groups of row groups (Parquet) or record batches (Arrow) of about `chunk` bytes."""
    if not file.splittable:
        try:
            file = _spill(file, index, spill_dir)
        except DataError as exc:
            yield Task(file, index, file.size, failure=str(exc))
            return
    try:
        sizes = parquet_sizes(file, field) if file.kind == "parquet" else arrow_sizes(file, field)
    except UnreadableError as exc:
        yield Task(file, index, file.size, failure=str(exc))
        return
    groups, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= chunk or i == len(sizes) - 1:
            groups.append((start, i + 1))
            start, acc = i + 1, 0
    total, before, counted = max(sum(sizes), 1), 0, 0
    for a, b in groups or [(0, 0)]:
        before += sum(sizes[a:b])
        share = file.size * before // total if b < len(sizes) else file.size  # shares add up to the file
        yield Task(file, index, share - counted, a, b)
        counted = share


def _spill(file: InputFile, index: int, spill_dir: str) -> InputFile:
    """A local, decompressed copy of a compressed or remote Parquet/Arrow file (they need seeking)."""
    path = os.path.join(spill_dir, f"{index:06d}-{os.path.basename(file.name)}")
    with file.open_raw() as raw, open(path, "wb") as out:
        if file.compression is None:
            shutil.copyfileobj(raw, out, READ_BLOCK)
        else:
            for block in decompressed(raw, file):
                out.write(block)
    return replace(file, compression=None, path=path)


class UnreadableError(DataError):
    """The file is damaged (not a wrong --field): skippable with --on-error=skip."""


def parquet_sizes(file: InputFile, field: str) -> list[int]:
    """Uncompressed bytes of each row group; checks that the text column is there."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file.path).metadata
    except Exception as exc:
        raise UnreadableError(f"{file.name} is not a readable Parquet file: {exc}") from exc
    check_column(file, field, meta.schema.to_arrow_schema())
    return [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]


def arrow_sizes(file: InputFile, field: str) -> list[int]:
    """Bytes of each record batch of an Arrow IPC file or stream (as `datasets` writes them)."""
    try:
        reader = open_arrow(file.path)
        schema = reader.schema
        check_column(file, field, schema)
        if hasattr(reader, "num_record_batches"):
            return [reader.get_batch(i).nbytes for i in range(reader.num_record_batches)]
        return [batch.nbytes for batch in reader]
    except DataError:
        raise
    except Exception as exc:
        raise UnreadableError(f"{file.name} is not a readable Arrow file: {exc}") from exc


def open_arrow(path: str | None):
    """A reader over the record batches of an Arrow IPC file, or of a stream (`save_to_disk`)."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(source)


def check_column(file: InputFile, field: str, schema) -> None:
    if field not in schema.names:
        raise DataError(f"{file.name} has no column {field!r} (columns: {schema.names}); pass --field NAME")
    import pyarrow as pa

    kind = schema.field(field).type
    if pa.types.is_dictionary(kind):  # pandas' Categorical, a dictionary-encoded column: its values count
        kind = kind.value_type
    kind = str(kind)
    if kind not in TEXT_TYPES:
        raise DataError(f"{file.name}: column {field!r} holds {kind}, not text; pass --field NAME")
