"""Text, JSONL and Parquet inputs into token shards (the engine behind `megascale prep`).

Inputs are cut into tasks (a text file; a ~64 MiB range of whole lines of a JSONL file; a
Parquet row group) that worker processes tokenise independently; the parent writes their
results in task order, so the output is the same for any number of workers. Every bad input
stops with an error naming the file (and line or row), and nothing is left at the output path
(the dataset is written to a temporary directory and renamed when complete).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from megascale.data.shards import DataError, ShardWriter, dtype_for_vocab, pack
from megascale.data.tokenizer import Tokenizer, load_tokenizer

CHUNK_BYTES = 64 << 20
SUFFIXES = {".txt": "text", ".md": "text", ".py": "text", ".rst": "text",
            ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class Task:
    """A piece of one input file that one worker tokenises: bytes [start, end) or a row group."""

    path: Path
    kind: str  # text | jsonl | parquet
    start: int = 0
    end: int = 0
    row_group: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Options:
    kind: str = "auto"  # auto | text | jsonl | parquet
    field: str = "text"


def find_inputs(inputs: list[str], kind: str) -> list[tuple[Path, str]]:
    """Files named or found under directories, sorted, each with its format."""
    found: list[tuple[Path, str]] = []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise DataError(f"input {path} does not exist")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            fmt = kind if kind != "auto" else SUFFIXES.get(file.suffix.lower())
            if fmt is None and path.is_dir():
                continue  # a directory's other files
            if fmt is None:
                raise DataError(f"cannot tell the format of {file}; pass --format")
            found.append((file, fmt))
    if not found:
        raise DataError(f"no input files found in {', '.join(inputs)} (empty input)")
    return found


def plan_tasks(files: list[tuple[Path, str]], field: str) -> list[Task]:
    tasks: list[Task] = []
    for path, kind in files:
        if kind == "parquet":
            meta = _parquet_file(path, field).metadata
            tasks += [Task(path, kind, row_group=g, end=meta.row_group(g).total_byte_size)
                      for g in range(meta.num_row_groups)]
        elif kind == "jsonl":
            tasks += [Task(path, kind, a, b) for a, b in _line_ranges(path)]
        else:
            tasks.append(Task(path, kind, 0, path.stat().st_size))
    return tasks


def _parquet_file(path: Path, field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is in the test extra
        raise DataError(
            f"{path}: reading Parquet needs pyarrow (pip install 'megascale[parquet]' or pip install pyarrow)"
        ) from exc
    try:
        file = pq.ParquetFile(path)
    except Exception as exc:
        raise DataError(f"{path} is not a readable Parquet file: {exc}") from exc
    if field not in file.schema_arrow.names:
        raise DataError(f"{path} has no column {field!r} (columns: {file.schema_arrow.names})")
    return file


def _line_ranges(path: Path) -> Iterator[tuple[int, int]]:
    """Byte ranges of about CHUNK_BYTES that start and end at line boundaries."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = 0
        while start < size:
            f.seek(min(start + CHUNK_BYTES, size))
            f.readline()
            end = min(f.tell(), size)
            yield start, end
            start = end


# -- the workers' side ---------------------------------------------------------------------
_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _TOKENIZER = load_tokenizer(spec)


def documents(task: Task, field: str) -> Iterator[bytes]:
    """The raw documents of one task; bad lines and rows raise DataError with their place."""
    if task.kind == "text":
        yield task.path.read_bytes()
    elif task.kind == "jsonl":
        with open(task.path, "rb") as f:
            f.seek(task.start)
            data = f.read(task.size)
        for i, line in enumerate(data.splitlines()):
            if line.strip():
                yield _json_field(task, field, line, i)
    else:
        column = _parquet_file(task.path, field).read_row_group(task.row_group, columns=[field])
        for i, value in enumerate(column.column(0).to_pylist()):
            if not isinstance(value, str | bytes):
                raise DataError(f"{task.path}: row group {task.row_group}, row {i}: column "
                                f"{field!r} holds {type(value).__name__}, not text")
            yield value.encode() if isinstance(value, str) else value


def _json_field(task: Task, field: str, line: bytes, index: int) -> bytes:
    def where() -> str:  # line numbers are counted only when there is an error to report
        with open(task.path, "rb") as f:
            before = f.read(task.start).count(b"\n")
        return f"{task.path}:{before + index + 1}"

    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where()}: not valid JSON ({exc.msg})") from exc
    if not isinstance(record, dict) or field not in record:
        raise DataError(f"{where()}: no field {field!r} in this record (use --field NAME)")
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where()}: field {field!r} is {type(value).__name__}, not a string")
    return value.encode()


def tokenize_task(args: tuple[Task, str]) -> tuple[np.ndarray, int, int]:
    """(packed tokens with an end-of-document token after each document, documents, bytes)."""
    task, field = args
    assert _TOKENIZER is not None
    docs = [_TOKENIZER.encode(d) for d in documents(task, field) if d]
    dtype = dtype_for_vocab(_TOKENIZER.vocab_size)
    return pack(docs, _TOKENIZER.eod, dtype), len(docs), task.size


# -- the parent ----------------------------------------------------------------------------
def train_tokenizer(tasks: list[Task], field: str, vocab_size: int, out: Path) -> Path:
    """A byte-level BPE of `vocab_size` tokens trained on the inputs, saved as tokenizer.json."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (d.decode("utf-8", errors="replace") for t in tasks for d in documents(t, field))
    tok.train_from_iterator(texts, trainer=trainer)
    path = out / "tokenizer.json"
    tok.save(str(path))
    return path


def prepare(inputs: list[str], out: str | Path, tokenizer: str = "bytes", *,
            options: Options = Options(), workers: int = 1, train_vocab: int = 0,
            shard_tokens: int = 1 << 26, overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenise `inputs` into a token directory at `out`; returns the manifest."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise DataError(f"output {out} already exists (pass --overwrite to replace it)")
    tasks = plan_tasks(find_inputs(inputs, options.kind), options.field)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if train_vocab:
            tokenizer = str(train_tokenizer(tasks, options.field, train_vocab, tmp))
        tok = load_tokenizer(tokenizer)
        writer = ShardWriter(tmp, dtype_for_vocab(tok.vocab_size), tok.eod, shard_tokens)
        for packed, docs in _run_tasks(tasks, options.field, tokenizer, workers, progress):
            if docs:
                writer.add_packed(packed, docs)
        if not writer.shards and writer.pending_tokens == 0:
            raise DataError(f"the inputs {', '.join(inputs)} hold no text (empty input)")
        source = {"kind": "prep", "inputs": [str(p) for p in inputs], "format": options.kind,
                  "field": options.field, "files": len({t.path for t in tasks})}
        identity = tok.identity()
        if train_vocab:
            identity["name"] = f"bpe-{train_vocab} (trained by prep, tokenizer.json)"
        manifest = writer.finish(identity, source)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _run_tasks(tasks: list[Task], field: str, tokenizer: str, workers: int,
               show: bool) -> Iterator[tuple[np.ndarray, int]]:
    total = sum(t.size for t in tasks)
    columns = [TextColumn("prep"), BarColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, disable=not show) as bar:
        task_id = bar.add_task("tokenising", total=total)
        if workers <= 1:
            _init_worker(tokenizer)
            results = map(tokenize_task, ((t, field) for t in tasks))
            for packed, docs, size in results:
                bar.advance(task_id, size)
                yield packed, docs
            return
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads
        with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
            for packed, docs, size in pool.imap(tokenize_task, ((t, field) for t in tasks)):
                bar.advance(task_id, size)
                yield packed, docs
