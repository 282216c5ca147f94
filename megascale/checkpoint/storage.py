"""Checkpoint storage through fsspec: names, durable writes, atomic renames and listing.

A checkpoint is a directory `step_<N>` (a re-save of the same step: `step_<N>.g<K>`, a new
generation) holding one data file per writing rank and `manifest.json`, written last. It is
built under a temporary name (`step_<N>.tmp-<run id>`) and renamed, to a name that does not
exist yet, when complete: a directory with a committed name is whole or not there, and a commit
never moves or deletes the checkpoint it supersedes. On local filesystems every file and
directory involved is fsynced around the rename, so a commit survives a power loss; other
fsspec targets (object stores, HDFS) give their own durability when a write completes. This
module imports no torch: the stage-2 writer process uses it.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

MANIFEST = "manifest.json"
LATEST = "latest"
_COMMITTED = re.compile(r"^step_(\d{9})(?:\.g(\d{1,6}))?$")
_TEMPORARY = re.compile(r"^step_(\d{9})\.tmp-[0-9a-f]+$")
QUARANTINE = ".invalid-"  # suffix of an invalid checkpoint moved aside: never loaded, kept to inspect


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt or does not fit this job."""


def step_name(step: int, generation: int = 0) -> str:
    return f"step_{step:09d}" + (f".g{generation}" if generation else "")


def parse_name(name: str) -> tuple[int, int] | None:
    """(step, generation) of a committed checkpoint's directory name, else None."""
    match = _COMMITTED.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def data_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def sidecar_file(rank: int) -> str:
    """Per-rank index, written after the data file; merged into the manifest at commit."""
    return f"rank-{rank:05d}.json"


def failed_file(rank: int) -> str:
    return f"rank-{rank:05d}.failed"


def open_root(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the root path of a local directory or any fsspec URL."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def sync_file(fs: fsspec.AbstractFileSystem, f: Any, durable: bool = True) -> None:
    """Flush an open file to the disk (local filesystems; elsewhere closing the file commits it)."""
    if durable and is_local(fs):
        f.flush()
        os.fsync(f.fileno())


def sync_dir(fs: fsspec.AbstractFileSystem, path: str, durable: bool = True) -> None:
    """Make a directory's entries (files created or renamed in it) durable."""
    if durable and is_local(fs):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rename(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    """Atomic on local filesystems, and never into or over an existing directory there
    (`os.rename` refuses a non-empty target; fsspec's local `mv` would move src inside it)."""
    if is_local(fs):
        os.rename(src, dst)
    else:
        fs.mv(src, dst, recursive=True)


def write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes, durable: bool = True) -> None:
    """Write under a temporary name, sync, rename: readers see all of it or nothing."""
    part = path + ".part"
    with fs.open(part, "wb") as f:
        f.write(data)
        sync_file(fs, f, durable)
    rename(fs, part, path)


def write_json(fs: fsspec.AbstractFileSystem, path: str, data: Any, durable: bool = True) -> None:
    write_bytes(fs, path, json.dumps(data, indent=1, sort_keys=True).encode(), durable)


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> tuple[Any, int]:
    """The parsed JSON and the number of bytes read."""
    with fs.open(path, "rb") as f:
        raw = f.read()
    return json.loads(raw), len(raw)


@contextlib.contextmanager
def paused_gc():
    """No cyclic garbage collection inside: building millions of small containers (a manifest
    at 12,288 ranks) otherwise triggers collections that walk them all, again and again (3x the
    time of json.loads and of the schema check at 1,024 ranks). They hold no cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One directory under the checkpoint root."""

    name: str
    step: int
    path: str
    generation: int = 0


def committed(fs: fsspec.AbstractFileSystem, root: str) -> list[Entry]:
    """Directories with a committed name, highest (step, generation) first; whether each holds
    a valid checkpoint, and which was committed last, is `catalog.survey`'s job."""
    out = []
    for name in _names(fs, root):
        parsed = parse_name(name)
        if parsed is not None:
            out.append(Entry(name, parsed[0], join(root, name), parsed[1]))
    return sorted(out, key=lambda e: (e.step, e.generation), reverse=True)


def temporaries(fs: fsspec.AbstractFileSystem, root: str) -> list[Entry]:
    """Saves that never committed (in progress, or left by a killed or failed save)."""
    return [Entry(n, int(m.group(1)), join(root, n)) for n in _names(fs, root) if (m := _TEMPORARY.match(n))]


def _names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    try:
        listing = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):  # nothing saved there yet
        return []
    return [os.path.basename(info["name"].rstrip("/")) for info in listing if info.get("type") == "directory"]


def remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)
