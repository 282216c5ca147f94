"""Files only this user can read or redirect: 0700 directories, 0600 files, no link following.

Why: run and work directories hold secrets (the driver's token and TLS key, the Redis password,
the job's config) and files that an executor, often root, appends to. Another local user must
be able neither to read them nor to plant a directory or a symbolic link that redirects a write
(the classic attack on a predictable path in /tmp). Nothing here imports the rest of megascale.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class UnsafePathError(OSError):
    """A path another user controls, or a link where a plain file or directory was expected."""


def private_dir(path: str | Path) -> Path:
    """`path` as a directory (made 0700 if new) that no other user can enter, replace or redirect.

    Refused: a symbolic link, something that is not a directory, a directory owned by another
    user, or one whose parent chain another user could rename (owned by them, or writable by
    all without the sticky bit, as /tmp is not: /tmp has it).
    """
    path = Path(os.path.abspath(path))
    _check_parents(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is a symbolic link or not a directory; remove it or choose another path")
    _check_owner(path, st)
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _check_parents(path: Path) -> None:
    for parent in (path, *path.parents):
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue  # made by us below, with our umask
        if st.st_uid not in (0, os.geteuid()):
            raise UnsafePathError(
                f"{parent} belongs to uid {st.st_uid}, who could replace what we put under it; "
                "choose a directory of your own"
            )
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UnsafePathError(
                f"{parent} is writable by every user without the sticky bit; choose a directory of your own"
            )


def _check_owner(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            "another user may have made it first; remove it or choose another path"
        )


def open_private(path: str | Path, append: bool = True) -> int:
    """A descriptor for writing `path` (made 0600): never through a link, never someone else's file."""
    flags = os.O_WRONLY | os.O_CREAT | O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafePathError(f"{path} is a symbolic link; refusing to write through it") from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafePathError(f"{path} is not a plain file of this user with one name (a planted hard link?)")
    return fd


def write_private(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` atomically with `data`, readable by this user only (0600)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_secret(path: str | Path, what: str) -> bytes:
    """The bytes of a secret file that other users cannot read or change (a link is followed:
    Kubernetes mounts a Secret's keys as links into a private directory). The type is checked
    on the open descriptor before a byte is read: a FIFO planted in its place must not hang us."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UnsafePathError(f"{what} {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(
                f"{what} {path} is not a regular file (a FIFO, device or directory); replace it with the file itself"
            )
        if st.st_uid not in (0, os.geteuid()):
            raise UnsafePathError(f"{what} {path} belongs to uid {st.st_uid}, not to this user or root")
        if st.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
            raise UnsafePathError(
                f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users can read "
                f"or change it; chmod 600 {path}"
            )
        return f.read()


def check_secret_dir(path: str | Path, what: str) -> None:
    """A directory holding secrets: ours or root's, and no other user may add or swap its entries
    (group/world-writable only with the sticky bit, as a Kubernetes Secret volume is mounted)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UnsafePathError(f"{what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} {path} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafePathError(f"{what} {path} belongs to uid {st.st_uid}, not to this user or root")
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP) and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users can replace "
            f"its files; chmod 700 {path}"
        )
