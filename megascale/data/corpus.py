"""The embedded default corpus: Python's standard library sources, byte-level, no download.

Every machine that runs `megascale` has these files, so the default job trains on real text
without a network. Built once into `<cache_dir>/stdlib-bytes/` (in a temporary directory, then
renamed, under a file lock so that concurrent ranks build it once) and reused afterwards.
"""

from __future__ import annotations

import fcntl
import functools
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from rich.progress import Progress

from megascale.data.shards import MANIFEST, DataError, ShardWriter, dtype_for_vocab, read_manifest
from megascale.data.tokenizer import ByteTokenizer

NAME = "stdlib-bytes"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's .py files, sorted by relative path, without tests and packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.cache
def source() -> dict:
    """The corpus's identity (a walk of the stdlib, a second on a busy disk): once per process."""
    root, files = stdlib_files()
    return {"kind": "python-stdlib", "root": str(root), "python": sys.version.split()[0], "files": len(files)}


def ensure_default_corpus(cache_dir: str | Path) -> Path:
    """Return the prepared default corpus directory, building it on first use."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / NAME
    if _usable(target):
        return target
    with open(cache / f".{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it right now
        if not _usable(target):
            _build(cache, target)
    return target


def _usable(target: Path) -> bool:
    """A complete corpus made from this Python's stdlib (shards checked when it is opened)."""
    if not (target / MANIFEST).is_file():
        return False
    try:
        manifest = read_manifest(target)
    except DataError:
        return False
    return manifest.get("source") == source() and all((target / s["file"]).is_file() for s in manifest["shards"])


def _build(cache: Path, target: Path) -> None:
    root, files = stdlib_files()
    if not files:
        raise DataError(f"no .py files found under the standard library at {root}")
    tok = ByteTokenizer()
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=cache))
    try:
        writer = ShardWriter(tmp, dtype_for_vocab(tok.vocab_size), tok.eod)
        with Progress(transient=False) as progress:
            task = progress.add_task(f"default corpus: tokenising {len(files)} stdlib files", total=len(files))
            for path in files:
                writer.add(tok.encode(path.read_bytes()))
                progress.advance(task)
        manifest = writer.finish(tok.identity(), source())
        if target.exists():  # stale (another Python): move aside, then replace
            stale = Path(tempfile.mkdtemp(prefix=f".{NAME}-stale-", dir=cache))
            target.rename(stale / NAME)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(
        f"default corpus ready: {target} ({manifest['documents']} documents, {manifest['tokens']:,} tokens)", flush=True
    )
