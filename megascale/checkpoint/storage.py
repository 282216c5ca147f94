"""Checkpoint storage through fsspec: names, the manifest, validation, listing and pruning.

A checkpoint is a directory `step_<N>` holding one data file per writing rank and
`manifest.json`, written last, with every file's size and sha256. It is built under a
temporary name (`step_<N>.tmp-<run id>`) and renamed when complete, so a directory with the
committed name is either whole or not there. This module imports no torch: the stage-2 writer
process uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import fsspec

FORMAT = "megascale-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
_COMMITTED = re.compile(r"^step_(\d{9})$")
_TEMPORARY = re.compile(r"^step_(\d{9})\.(tmp|replaced)-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt or does not fit this job."""


def step_name(step: int) -> str:
    return f"step_{step:09d}"


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


def write_json(fs: fsspec.AbstractFileSystem, path: str, data: Any) -> None:
    """Write JSON under a temporary name, then rename: readers see all of it or nothing."""
    part = path + ".part"
    with fs.open(part, "wb") as f:
        f.write(json.dumps(data, indent=1, sort_keys=True).encode())
    fs.mv(part, path)


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> tuple[Any, int]:
    """The parsed JSON and the number of bytes read."""
    with fs.open(path, "rb") as f:
        raw = f.read()
    return json.loads(raw), len(raw)


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One directory under the checkpoint root."""

    name: str
    step: int
    path: str


def committed(fs: fsspec.AbstractFileSystem, root: str) -> list[Entry]:
    """Committed checkpoints under root, newest first (none if root does not exist)."""
    return sorted(_entries(fs, root, _COMMITTED), key=lambda e: e.step, reverse=True)


def temporaries(fs: fsspec.AbstractFileSystem, root: str) -> list[Entry]:
    return _entries(fs, root, _TEMPORARY)


def _entries(fs: fsspec.AbstractFileSystem, root: str, pattern: re.Pattern) -> list[Entry]:
    try:
        listing = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):  # nothing saved there yet
        return []
    out = []
    for info in listing:
        name = os.path.basename(info["name"].rstrip("/"))
        match = pattern.match(name)
        if match and info.get("type") == "directory":
            out.append(Entry(name, int(match.group(1)), join(root, name)))
    return out


def check_manifest(fs: fsspec.AbstractFileSystem, path: str) -> tuple[dict, int]:
    """Read a checkpoint's manifest and check, without reading data, that it is complete:
    the format is ours and every listed file exists with its recorded size.
    Returns (manifest, manifest bytes). Checksums are verified when the data is read."""
    manifest_path = join(path, MANIFEST)
    if not fs.exists(manifest_path):
        raise CheckpointError(f"{path} is partial: it has no {MANIFEST}")
    try:
        manifest, nbytes = read_json(fs, manifest_path)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: format version {manifest.get('version')}, expected {VERSION}")
    for name, info in manifest["files"].items():
        file_path = join(path, name)
        if not fs.exists(file_path):
            raise CheckpointError(f"{path} is partial: {name} is missing")
        size = fs.size(file_path)
        if size != info["size"]:
            raise CheckpointError(
                f"{path}: {name} has {size} bytes, the manifest says {info['size']}")
    manifest["manifest_bytes"] = nbytes
    return manifest, nbytes


def checkpoint_bytes(manifest: dict) -> int:
    """Bytes stored for a checkpoint: its data files and its manifest."""
    return sum(info["size"] for info in manifest["files"].values()) + manifest["manifest_bytes"]


def prune(fs: fsspec.AbstractFileSystem, root: str, keep: int, newest: int) -> list[str]:
    """Delete committed checkpoints beyond the newest `keep` and temporaries of steps older
    than `newest` (left by killed or failed saves). Returns the names removed."""
    removed = []
    for entry in committed(fs, root)[keep:]:
        fs.rm(entry.path, recursive=True)
        removed.append(entry.name)
    for entry in temporaries(fs, root):
        if entry.step < newest:
            fs.rm(entry.path, recursive=True)
            removed.append(entry.name)
    return removed
