"""Text, JSON lines, Parquet and Arrow inputs into token shards (the engine behind `megascale prep`).

The inputs are cut into tasks (tasks.py) that worker processes encode (records.py); the parent
takes their results in task order, counts them (ledger.py) and writes the shards, which end at
document boundaries whatever the tasks were, so the output is byte-identical for any number of
workers. At most two tasks per worker are in flight, so memory does not grow with the input.
Every bad input stops the run with its place, or is skipped and counted; nothing is left at the
output path unless the run completes (it is written to a temporary directory, then renamed).
This module does not import torch: a `prep` run starts in a fraction of a second.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from megascale.data.inputs import InputFile, find_inputs
from megascale.data.ledger import REJECTED, Ledger
from megascale.data.records import Encoder, Job, TaskResult
from megascale.data.shards import DataError, ShardWriter, dtype_for_vocab
from megascale.data.tasks import Task, plan
from megascale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

CHUNK_MIN, CHUNK_MAX = 256 << 10, 4 << 20  # bytes of input per task


@dataclass(frozen=True)
class Options:
    kind: str = "auto"  # auto | text | lines | jsonl | parquet | arrow
    field: str = "text"
    on_error: str = "stop"  # stop | skip: what a bad record does
    replace_invalid: bool = False  # invalid UTF-8 and lone surrogates become U+FFFD (counted)
    eod_token: str | None = None  # --eod-token: end documents with this token (None: the tokenizer's own)
    bos: str | None = None  # --bos: this token, or "none", before every document (None: the tokenizer's own)


def auto_workers(total: int) -> int:
    """One process per core this process may run on, but none beyond one per CHUNK_MIN of input
    (each costs a start-up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, total // CHUNK_MIN))


def chunk_size(total: int, workers: int) -> int:
    """Four tasks per worker for small inputs, at most CHUNK_MAX for big ones (bounded memory)."""
    return int(min(CHUNK_MAX, max(CHUNK_MIN, total // (4 * workers))))


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bytes",
    *,
    options: Options = Options(),
    workers: int = 0,
    train_vocab: int = 0,
    shard_tokens: int = 1 << 26,
    overwrite: bool = False,
    progress: bool | object = True,
    chunk_bytes: int = 0,
    say: Callable[[str], None] | None = None,
) -> dict:
    """Tokenise `inputs` into a token directory at `out`; returns the manifest.
    `workers` 0 picks one per core (fewer for small inputs); `progress` is True/False or a rich
    Console to draw the bar on; `say` prints notes (default: stderr)."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    out = Path(out)
    if out.exists() and not overwrite:
        raise DataError(f"output {out} already exists (pass --overwrite to replace it)")
    found = find_inputs(inputs, options.kind)
    total = sum(f.size for f in found.files)
    workers = workers or auto_workers(total)
    chunk = chunk_bytes or chunk_size(total, workers)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700: the output is shared as any new directory is
    spill = tempfile.mkdtemp(prefix=f".{out.name}-spill-", dir=out.parent)
    job = Job(tokenizer, options.field, options.replace_invalid, options.eod_token, options.bos)
    try:
        if train_vocab:
            job = replace(
                job,
                tokenizer=str(train_tokenizer(plan(found.files, options.field, chunk, spill), job, train_vocab, tmp)),
            )
        tok = load_tokenizer(job.tokenizer, job.eod_token, job.bos)
        for note in tok.notes:
            say(f"megascale prep: note: {note}")
        writer = ShardWriter(tmp, dtype_for_vocab(tok.vocab_size), tok.eod, shard_tokens)
        ledger = Ledger(tmp, options.on_error, total)
        try:
            previous: Task | None = None
            for task, result in run_tasks(
                plan(found.files, options.field, chunk, spill), job, workers, total, progress, tok
            ):
                if previous is not None and previous.index != task.index:
                    _drop_spill(previous.file, spill)
                ledger.add(task, result)
                if result.continues:
                    writer.add_open(result.packed)
                else:
                    writer.add_packed(result.packed, result.lengths)
                previous = task
        finally:
            ledger.close()
        if writer.tokens_written == 0:
            skipped = f"; skipped: {dict(ledger.skipped)}" if ledger.skipped else ""
            raise DataError(f"the inputs {', '.join(inputs)} hold no text (empty input){skipped}")
        ledger.check(writer)
        identity = tok.identity()
        if train_vocab:
            identity.update(
                name=f"bpe-{train_vocab} (trained by prep, tokenizer.json)",
                path=str((out / "tokenizer.json").resolve()),
            )
        source = {
            "kind": "prep",
            "inputs": [str(p) for p in inputs],
            "format": options.kind,
            "field": options.field,
            "on_error": options.on_error,
            "replace_invalid": options.replace_invalid,
            "files": len(found.files),
            "ignored_files": len(found.ignored),
            "ignored_examples": found.ignored[:20],
        }
        extra: dict = {"counts": ledger.summary(), "notes": tok.notes}
        if ledger.skipped:
            extra["rejected"] = REJECTED
        manifest = writer.finish(identity, source, **extra)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    return manifest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def train_tokenizer(tasks: Iterator[Task], job: Job, vocab_size: int, out: Path) -> Path:
    """A byte-level BPE of `vocab_size` tokens trained on the inputs, saved as tokenizer.json.
    Bad records are left out here; the encoding pass reports or counts them."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    reader = Encoder(replace(job, tokenizer="bytes", eod_token=None, bos=None))

    def texts() -> Iterator[str]:
        for task in tasks:
            if task.failure is None:
                for _, value in reader.records(task, TaskResult(task.size)):
                    raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
                    yield raw.decode("utf-8", "replace")

    tok.train_from_iterator(texts(), trainer=trainer)
    path = out / "tokenizer.json"
    tok.save(str(path))
    return path


# -- running the tasks ---------------------------------------------------------------------
_ENCODER: Encoder | None = None


def _init_worker(job: Job) -> None:
    global _ENCODER
    _ENCODER = Encoder(job)


def _encode(task: Task) -> TaskResult:
    assert _ENCODER is not None
    return _ENCODER(task)


def run_tasks(
    tasks: Iterator[Task],
    job: Job,
    workers: int,
    total: int,
    progress: bool | object,
    tok: ByteTokenizer | HFTokenizer | None = None,
) -> Iterator[tuple[Task, TaskResult]]:
    """(task, result) in task order; with workers > 1, at most 2 x workers tasks in flight;
    with one, in this process with `tok` (the job's tokenizer, if loaded already)."""
    with _progress_bar(total, progress) as advance:
        if workers <= 1:
            encode = Encoder(job, tok)
            for task in tasks:
                result = encode(task)
                advance(task.size)
                yield task, result
            return
        pool = ProcessPoolExecutor(
            workers,
            mp_context=mp.get_context("spawn"),  # no fork of a threaded parent
            initializer=_init_worker,
            initargs=(job,),
        )
        pending: deque = deque()
        try:
            for task in tasks:
                pending.append((task, pool.submit(_encode, task)))
                if len(pending) >= 2 * workers:
                    done, future = pending.popleft()
                    advance(done.size)
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                advance(done.size)
                yield done, future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def _progress_bar(total: int, progress: bool | object) -> Iterator[Callable[[int], None]]:
    """A bar over the stored bytes of all inputs (compressed size for compressed files)."""
    if progress is False:  # no bar: rich is not even imported (0.1 s of a short run)
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = progress if isinstance(progress, Console) else Console(stderr=True)
    columns = [TextColumn("prep"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, disable=progress is False) as bar:
        task_id = bar.add_task("tokenising", total=total)
        yield lambda n: bar.advance(task_id, n)


def _drop_spill(file: InputFile, spill_dir: str) -> None:
    """A compressed or remote Parquet/Arrow file's local copy, once all its tasks are done."""
    if file.path is not None and os.path.dirname(file.path) == spill_dir:
        os.remove(file.path)
