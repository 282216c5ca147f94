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
from urllib.parse import urlsplit, urlunsplit

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



def with_generated_password(url: str, keep: str | Path | None = None) -> str:
    """`url` (a job's own redis-server, `parallel.redis_start`, configured without a password)
    with a generated password in it: no job's Redis runs without one, as on loopback too every
    local user could otherwise read and rewrite the rendezvous keys. With `keep`, the password
    is made once into that 0600 file and read again from it (a restarted driver adopts the
    server). Ranks never see the URL's password (`config_text` strips it)."""
    if keep is None:
        password = secrets.token_urlsafe(32)
    else:
        keep = Path(keep)
        if not os.path.lexists(keep):
            write_private(keep, secrets.token_urlsafe(32))
        password = read_secret(keep, "the job's Redis password").decode(errors="replace").strip()
        if len(password) < 16 or not password.replace("-", "").replace("_", "").isalnum():
            raise UnsafePathError(f"{keep} holds no usable Redis password; remove it to make a new one")
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f":{password}@{parts.netloc.rpartition('@')[2]}"))
