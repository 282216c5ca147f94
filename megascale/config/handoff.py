"""How ranks receive their job config: one resolved TOML file, never `--key=value` strings.

A launcher (`megascale train --nproc`, the driver through its executors) resolves the config
once and every rank reads the same file, readable by the user only. The Redis password is never
in it, nor in a rank's command line or environment: ranks get the path of a 0600 file holding
it ($MEGASCALE_REDIS_PASSWORD_FILE, read by `ParallelConfig.redis_password`).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import tomli_w

from megascale.config.loader import to_dict, typed_config
from megascale.config.private_files import UnsafePathError, private_dir, read_secret, write_private
from megascale.config.schema import REDIS_PASSWORD_FILE_ENV, JobConfig, redacted_url


def config_text(cfg: JobConfig) -> str:
    """The TOML of `cfg` as ranks read it: every value resolved, no password in the Redis URL."""
    raw = to_dict(cfg)
    raw["parallel"]["redis_url"] = redacted_url(cfg.parallel.redis_url, mask=None)
    return tomli_w.dumps(raw)


def attempt_config(text: str, *, dp: int, run_dir: str, redis_password: str | None = None) -> str:
    """The ranks' config of one driver attempt: the job's (`text`, from `config_text`) with the
    attempt's dp degree and run directory, resuming from the newest valid checkpoint, and no save
    on SIGTERM (the driver stops a failed attempt's ranks itself and restarts from the last
    commit). Edited as a typed `JobConfig` and validated as a rank will validate it (with the
    Redis password the ranks get apart, which the text lacks), so a layout the ranks would
    reject is a `ConfigError` naming the key in the driver, not at every rank."""
    cfg = typed_config(text, "the job's config")
    cfg = replace(
        cfg,
        parallel=replace(cfg.parallel, dp=dp),
        train=replace(cfg.train, run_dir=run_dir),
        checkpoint=replace(cfg.checkpoint, resume="auto", save_on_signal=False),
    )
    url = cfg.parallel.redis_url
    as_ranks_see_it = replace(cfg, parallel=replace(cfg.parallel, redis_url=_with_password(url, redis_password)))
    as_ranks_see_it.validate()
    return config_text(cfg)


def _with_password(url: str, password: str | None) -> str:
    if not password:
        return url
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:{quote(password, safe='')}@{host}"))


def with_generated_password(url: str, keep: str | Path | None = None) -> str:
    """`url` (a job's own redis-server, `parallel.redis_start`, configured without a password)
    with a generated password in it: no job's Redis runs without one, as on loopback too every
    local user could otherwise read and rewrite the rendezvous keys. With `keep`, the password
    is made once into that 0600 file and read again from it (a restarted driver adopts the
    server). Ranks never see the URL's password (`config_text` strips it)."""
    if keep is None:
        return _with_password(url, secrets.token_urlsafe(32))
    keep = Path(keep)
    if not os.path.lexists(keep):
        write_private(keep, secrets.token_urlsafe(32))
    password = read_secret(keep, "the job's Redis password").decode(errors="replace").strip()
    if len(password) < 16:
        raise UnsafePathError(f"{keep} holds no usable Redis password; remove it to make a new one")
    return _with_password(url, password)


def write_rank_files(directory: str | Path, text: str, password: str | None) -> tuple[Path, dict[str, str]]:
    """Write the config (and the password) into a private directory; returns the config's path and
    the environment variables that point the ranks at the password file."""
    directory = private_dir(directory)
    path = write_private(directory / "config.toml", text)
    if not password:
        return path, {}
    return path, {REDIS_PASSWORD_FILE_ENV: str(write_private(directory / "redis_password", password))}
