"""Stage 2: persist a rank's host snapshot to storage, and (rank 0) commit the checkpoint.

Runs in a background process per rank (or inline for `checkpoint.async_save=false`). It reads
the snapshot from shared memory, so the training process only pays for stage 1. Each rank
writes and syncs its data file and then its index; rank 0 waits for every rank's index, writes
the sealed manifest (sizes and sha256 of every file, its own checksum, its commit sequence
number) last, syncs the directory, renames it to a committed name no directory has yet, syncs
the root, updates `latest`, then prunes, which first confirms that the new checkpoint is the
newest valid one. At every instant the newest committed checkpoint is complete and findable.
This module imports no torch, so the process starts quickly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megascale.checkpoint.catalog import next_commit, prune, survey
from megascale.checkpoint.manifest import seal
from megascale.checkpoint.shm import Segment, reap
from megascale.checkpoint.storage import (
    LATEST,
    MANIFEST,
    CheckpointError,
    data_file,
    failed_file,
    join,
    open_root,
    read_json,
    rename,
    sidecar_file,
    sync_dir,
    sync_file,
    write_bytes,
    write_json,
)

CHUNK = 4 << 20
# Called with "written" (manifest synced), "renamed" (committed), "latest" (pointer updated) on
# rank 0's commit; fault tests install a pause here and kill the process there. None in production.
COMMIT_HOOK: Callable[[str], None] | None = None


@dataclass
class WriteJob:
    step: int
    root: str  # checkpoint root (local path or fsspec URL)
    tmp_name: str  # step_<N>.tmp-<run id>
    rank: int
    world: int
    shm_name: str
    nbytes: int  # this rank's data file: the first nbytes of the shared buffer
    index: dict[str, Any]  # records and rank metadata, written as the rank's sidecar
    commit: dict[str, Any] | None  # manifest header; set on rank 0 only
    keep: int
    bytes_per_s: float  # 0 = unlimited
    commit_timeout_s: float
    durable: bool = True  # fsync files and directories (checkpoint.fsync)


def persist(job: WriteJob, buffer: memoryview, abort: Any = None) -> dict[str, Any]:
    """Write this rank's part; commit on rank 0. Raises on any failure (nothing committed).
    `abort` (a shared integer) cancels rank 0's wait for the other ranks of steps <= its value."""
    fs, root = open_root(job.root)
    tmp = join(root, job.tmp_name)
    start = time.perf_counter()
    try:
        fs.makedirs(tmp, exist_ok=True)
        digest = _write_data(fs, join(tmp, data_file(job.rank)), buffer[: job.nbytes], job.bytes_per_s, job.durable)
        index = dict(job.index, file=data_file(job.rank), size=job.nbytes, sha256=digest)
        write_json(fs, join(tmp, sidecar_file(job.rank)), index, job.durable)
    except Exception as exc:
        _report_failure(fs, join(tmp, failed_file(job.rank)), exc)
        raise
    result: dict[str, Any] = {"bytes": job.nbytes, "write_s": time.perf_counter() - start}
    if job.commit is not None:
        result.update(_commit(fs, root, tmp, job, abort))
    return result


def _write_data(fs, path: str, data: memoryview, bytes_per_s: float, durable: bool) -> str:
    digest = hashlib.sha256()
    start = time.perf_counter()
    with fs.open(path, "wb") as f:
        for offset in range(0, len(data), CHUNK):
            chunk = data[offset : offset + CHUNK]
            f.write(chunk)
            digest.update(chunk)
            if bytes_per_s > 0:  # stay under the configured bandwidth
                ahead = (offset + len(chunk)) / bytes_per_s - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)
        sync_file(fs, f, durable)
    return digest.hexdigest()


def _report_failure(fs, path: str, exc: BaseException) -> None:
    """Tell rank 0's committer not to wait for this rank (best effort: storage may be gone)."""
    with contextlib.suppress(Exception):
        fs.pipe(path, f"{type(exc).__name__}: {exc}".encode())


def _commit(fs, root: str, tmp: str, job: WriteJob, abort: Any) -> dict[str, Any]:
    indexes = _wait_for_ranks(fs, tmp, job, abort)
    files, tensors, ranks = {}, [], {}
    for rank, index in sorted(indexes.items()):
        files[index["file"]] = {"size": index["size"], "sha256": index["sha256"]}
        tensors += [dict(record, file=index["file"]) for record in index["records"]]
        ranks[str(rank)] = index["meta"]
    plain: dict[str, Any] = {}
    for index in indexes.values():
        plain.update(index["plain"])
    name, seq = next_commit(survey(fs, root), job.step)
    manifest = seal(dict(job.commit, seq=seq, files=files, tensors=tensors, ranks=ranks, plain=plain))
    write_json(fs, join(tmp, MANIFEST), manifest, job.durable)  # last: the checkpoint is complete
    for rank in range(job.world):
        fs.rm(join(tmp, sidecar_file(rank)))
    sync_dir(fs, tmp, job.durable)
    _reached("written")
    final = join(root, name)
    rename(fs, tmp, final)  # a new name: the checkpoint it supersedes stays until prune
    sync_dir(fs, root, job.durable)
    _reached("renamed")
    write_bytes(fs, join(root, LATEST), name.encode(), job.durable)
    sync_dir(fs, root, job.durable)
    _reached("latest")
    pruned = prune(fs, root, job.keep, name, job.tmp_name.rsplit("-", 1)[1], job.durable)
    total = sum(f["size"] for f in files.values())
    return {
        "path": final,
        "total_bytes": total,
        "removed": pruned.removed,
        "quarantined": pruned.quarantined,
        "unchecked": pruned.unchecked,
    }


def _reached(point: str) -> None:
    if COMMIT_HOOK is not None:
        COMMIT_HOOK(point)


def _wait_for_ranks(fs, tmp: str, job: WriteJob, abort: Any) -> dict[int, dict]:
    deadline = time.monotonic() + job.commit_timeout_s
    pending = set(range(job.world))
    indexes: dict[int, dict] = {}
    while pending:
        names = {os.path.basename(p.rstrip("/")) for p in fs.ls(tmp, detail=False)}
        for rank in sorted(pending):
            if sidecar_file(rank) in names:
                indexes[rank] = read_json(fs, join(tmp, sidecar_file(rank)))[0]
                pending.discard(rank)
            elif failed_file(rank) in names:
                reason = fs.cat(join(tmp, failed_file(rank))).decode(errors="replace")
                raise CheckpointError(f"rank {rank} could not write its part: {reason}")
        if not pending:
            break
        if abort is not None and abort.value >= job.step:
            raise CheckpointError(f"aborted: the writer of rank(s) {sorted(pending)} died")
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"ranks {sorted(pending)} did not finish writing within "
                f"checkpoint.commit_timeout_s={job.commit_timeout_s:g}"
            )
        time.sleep(0.02)
    return indexes


class Abort:
    """Steps <= value are cancelled (set by the trainer when another rank's writer died)."""

    value = -1


def serve() -> None:
    """The writer process: jobs and aborts as JSON lines on stdin, one result line per job on
    stdout. It ends at end of input (the trainer closed it or died), after the current job."""
    jobs: queue.Queue = queue.Queue()
    abort = Abort()

    def read_stdin() -> None:
        for line in sys.stdin:
            message = json.loads(line)
            if "abort" in message:
                abort.value = max(abort.value, message["abort"])
            else:
                jobs.put(WriteJob(**message["job"]))
        jobs.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    mapped: Segment | None = None
    while (job := jobs.get()) is not None:
        try:
            if mapped is None or mapped.name != job.shm_name:
                if mapped is not None:
                    mapped.close()
                mapped = Segment(job.shm_name)
            message = {"kind": "ok", "step": job.step, "info": persist(job, mapped.buf, abort)}
        except Exception as exc:
            message = {"kind": "error", "step": job.step, "info": f"{type(exc).__name__}: {exc}"}
        _report(message)
    if mapped is not None:
        mapped.close()
        reap(mapped.name)  # unlinked here only if the trainer is gone (nobody holds it any more)


def _report(message: dict[str, Any]) -> None:
    """One result line to the trainer; if the trainer is gone, the rest goes nowhere, quietly."""
    try:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit cannot fail either
        os.close(devnull)


if __name__ == "__main__":
    serve()
