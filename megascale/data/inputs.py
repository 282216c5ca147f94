"""Which files `prep` reads: paths, directories, globs and fsspec URLs, each with its format.

A file's format comes from its suffix after any compression suffix (`a.jsonl.zst` is JSON lines
compressed with zstd); a directory written by Hugging Face `datasets` (`save_to_disk`) is read
as its Arrow files in the order its `state.json` lists them. Files in a directory whose suffix
says nothing are left out, and counted so that the summary can say so.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from megascale.data.shards import DataError

FORMATS = {
    ".txt": "text",
    ".md": "text",
    ".rst": "text",
    ".py": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
KINDS = ("auto", "text", "lines", "jsonl", "parquet", "arrow")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2", ".xz": "xz"}
HF_STATE, HF_DICT = "state.json", "dataset_dict.json"


@dataclass(frozen=True)
class InputFile:
    """One input file. `path` is set for a file on this machine (workers open it themselves);
    other URLs are opened by the parent through fsspec."""

    name: str  # as shown in messages: the local path or the URL
    kind: str  # text | lines | jsonl | parquet | arrow
    compression: str | None
    size: int  # bytes as stored (compressed size for a compressed file)
    path: str | None = None

    @property
    def splittable(self) -> bool:
        """Workers can read any byte range or row group of it directly."""
        return self.path is not None and self.compression is None

    def open_raw(self):
        """The stored bytes (still compressed), as a binary file object."""
        if self.path is not None:
            return open(self.path, "rb")  # noqa: SIM115 - the caller closes it
        import fsspec

        return fsspec.open(self.name, "rb").open()


@dataclass
class Found:
    files: list[InputFile] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # files in directories with no known suffix


def find_inputs(items: list[str], kind: str = "auto") -> Found:
    """Every input file, in a stable order: the items as given, directory contents sorted."""
    found = Found()
    for item in items:
        if "://" in item:
            _add_url(found, item, kind)
        else:
            _add_local(found, item, kind)
    if not found.files:
        extra = (
            f" ({len(found.ignored)} files with unknown suffixes, e.g. {found.ignored[0]}; pass --format)"
            if found.ignored
            else ""
        )
        raise DataError(f"no input files found in {', '.join(items)} (empty input){extra}")
    return found


def classify(name: str, kind: str) -> tuple[str | None, str | None]:
    """(format, compression) of a file name; format None when the suffix says nothing."""
    suffixes = [s.lower() for s in PurePosixPath(name).suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    if kind != "auto":
        return kind, compression
    return (FORMATS.get(suffixes[-1]) if suffixes else None), compression


def _add_local(found: Found, item: str, kind: str) -> None:
    if glob.has_magic(item):
        names = sorted(glob.glob(item, recursive=True))
        if not names:
            raise DataError(f"no files match {item}")
        for name in names:
            _add_local(found, name, kind)
        return
    if not os.path.exists(item):
        raise DataError(f"input {item} does not exist")
    if not os.path.isdir(item):
        fmt, compression = classify(item, kind)
        if fmt is None:
            raise DataError(f"cannot tell the format of {item} from its name; pass --format ({', '.join(KINDS[1:])})")
        found.files.append(InputFile(item, fmt, compression, os.path.getsize(item), item))
        return
    groups: list[tuple[str, list[InputFile]]] = []  # sorted by path; a datasets directory as one
    for root, dirs, names in os.walk(item):
        arrow = _hf_dataset(root, set(names), kind)
        if arrow is not None:
            groups.append((root, arrow))
            dirs.clear()
            continue
        for name in names:
            path = os.path.join(root, name)
            fmt, compression = classify(name, kind)
            if fmt is None or name.startswith("."):
                found.ignored.append(path)
            else:
                groups.append((path, [InputFile(path, fmt, compression, os.path.getsize(path), path)]))
    for _, files in sorted(groups, key=lambda g: g[0]):
        found.files += files
    found.ignored.sort()


def _hf_dataset(root: str, names: set[str], kind: str) -> list[InputFile] | None:
    """The Arrow files of a `datasets` save_to_disk directory, in order; None if `root` is not one."""
    if HF_DICT in names:
        with open(os.path.join(root, HF_DICT)) as f:
            splits = json.load(f).get("splits", [])
        raise DataError(
            f"{root} is a Hugging Face DatasetDict with splits {splits}; pass one split's "
            f"directory, e.g. {os.path.join(root, splits[0] if splits else 'train')}"
        )
    if HF_STATE not in names or kind not in ("auto", "arrow"):
        return None
    with open(os.path.join(root, HF_STATE)) as f:
        state = json.load(f)
    files = []
    for entry in state.get("_data_files", []):
        path = os.path.join(root, entry["filename"])
        if not os.path.isfile(path):
            raise DataError(f"{path}, listed in {os.path.join(root, HF_STATE)}, is missing")
        files.append(InputFile(path, "arrow", None, os.path.getsize(path), path))
    return files


def _add_url(found: Found, url: str, kind: str) -> None:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, path = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):  # file://: workers read it like any local path
        _add_local(found, path, kind)
        return
    if glob.has_magic(path):
        paths = sorted(fs.glob(path))
        if not paths:
            raise DataError(f"no files match {url}")
    elif not fs.exists(path):
        raise DataError(f"input {url} does not exist")
    elif not fs.isdir(path):
        paths = [path]
    elif fs.exists(f"{path.rstrip('/')}/{HF_STATE}") and kind in ("auto", "arrow"):
        state = json.loads(fs.cat_file(f"{path.rstrip('/')}/{HF_STATE}"))
        paths = [f"{path.rstrip('/')}/{e['filename']}" for e in state.get("_data_files", [])]
        kind = "arrow"
    else:
        paths = sorted(fs.find(path))
    for p in paths:
        name = fs.unstrip_protocol(p)
        fmt, compression = classify(p, kind)
        if fmt is None and len(paths) == 1 and p == path:
            raise DataError(f"cannot tell the format of {url} from its name; pass --format ({', '.join(KINDS[1:])})")
        if fmt is None or PurePosixPath(p).name.startswith("."):
            found.ignored.append(name)
        else:
            found.files.append(InputFile(name, fmt, compression, int(fs.size(p))))
