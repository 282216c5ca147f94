"""How ranks receive their job config: one resolved TOML file, never `--key=value` strings.

A launcher (`megascale train --nproc`, the driver through its executors) resolves the config
once and every rank reads the same file, readable by the user only. The Redis password is never
in it, nor in a rank's command line or environment: ranks get the path of a 0600 file holding
it ($MEGASCALE_REDIS_PASSWORD_FILE, read by `ParallelConfig.redis_password`).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Any

import tomli_w

from megascale.config.loader import set_dotted, to_dict
from megascale.config.private_files import UnsafePathError, private_dir, read_secret, write_private
from megascale.config.schema import REDIS_PASSWORD_FILE_ENV, JobConfig, redacted_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def config_text(cfg: JobConfig) -> str:
    """The TOML of `cfg` as ranks read it: every value resolved, no password in the Redis URL."""
    raw = to_dict(cfg)
    raw["parallel"]["redis_url"] = redacted_url(cfg.parallel.redis_url, mask=None)
    return tomli_w.dumps(raw)


def with_overrides(text: str, values: dict[str, Any]) -> str:
    """`text` with dotted keys set, e.g. {"parallel.dp": 2} (the driver's per-attempt layout)."""
    raw = tomllib.loads(text)
    for key, value in values.items():
        set_dotted(raw, key, value)
    return tomli_w.dumps(raw)


def write_rank_files(directory: str | Path, text: str, password: str | None) -> tuple[Path, dict[str, str]]:
    """Write the config (and the password) into a private directory; returns the config's path and
    the environment variables that point the ranks at the password file."""
    directory = private_dir(directory)
    path = write_private(directory / "config.toml", text)
    if not password:
        return path, {}
    return path, {REDIS_PASSWORD_FILE_ENV: str(write_private(directory / "redis_password", password))}


def job_password_file(path: str | Path) -> Path:
    """A generated password for the job's own redis-server, kept in `path` (0600): made once,
    read again by a restarted launcher. No job's Redis runs without a password: on loopback too,
    every local user could otherwise read and rewrite the rendezvous keys."""
    path = Path(path)
    if not os.path.lexists(path):
        write_private(path, secrets.token_urlsafe(32))
    elif len(read_secret(path, "the job's Redis password").strip()) < 16:
        raise UnsafePathError(f"{path} holds no usable Redis password; remove it to make a new one")
    return path
