"""Files a rank writes into the run directory, which other users' links may be planted in: the
rank log, `metrics.jsonl` and the timer files are never written through a symbolic or hard link;
the job's own Redis always has a password."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from megascale.config import JobConfig, ParallelConfig
from megascale.config.handoff import config_text, with_generated_password
from megascale.config.private_files import UnsafePathError
from megascale.diagnostics.timers import Timers
from megascale.train.metrics import MetricsWriter, setup_logging

pytestmark = pytest.mark.timeout(60)
WRITERS = {
    "rank00000.log": lambda run: setup_logging(run, 0),
    "metrics.jsonl": lambda run: MetricsWriter(run, enabled=True, tensorboard=False),
    "timers/rank00000.jsonl": lambda run: Timers(0, {"dp": 0}, "host", run),
}


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim"
    path.write_text("another user's file\n")
    return path


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_planted_in_the_run_dir_is_not_written_through(tmp_path, victim, name, kind):
    run = tmp_path / "run"
    (run / "timers").mkdir(parents=True)
    (run / name).symlink_to(victim) if kind == "symlink" else os.link(victim, run / name)
    logger = logging.getLogger("megascale")
    handlers = list(logger.handlers)
    try:
        with pytest.raises(UnsafePathError, match="symbolic link" if kind == "symlink" else "one name"):
            WRITERS[name](run)
    finally:
        logger.handlers[:] = handlers
    assert victim.read_text() == "another user's file\n"


def test_the_jobs_redis_gets_a_generated_password_kept_for_a_restarted_driver(tmp_path):
    url = "redis://127.0.0.1:6390/0"
    keep = tmp_path / "redis_password"
    first = with_generated_password(url, keep)
    password = keep.read_text()
    assert first == f"redis://:{password}@127.0.0.1:6390/0" and len(password) >= 32
    assert stat.S_IMODE(keep.stat().st_mode) == 0o600
    assert with_generated_password(url, keep) == first  # a restarted driver: the same password
    assert with_generated_password(url) != with_generated_password(url)  # `train --nproc`: one per run
    cfg = JobConfig(parallel=ParallelConfig(store="redis", redis_start=True, redis_url=first))
    assert cfg.parallel.redis_password() == password and password not in config_text(cfg)  # ranks: not in the URL


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_driver_starts_the_jobs_redis_with_a_password(tmp_path):
    import redis

    from megascale.parallel.store import free_port
    from megascale.resilience.driver.cli import _job_redis
    from megascale.resilience.driver.state import JobState

    port = free_port()
    parallel = ParallelConfig(store="redis", redis_start=True, redis_url=f"redis://127.0.0.1:{port}/0")
    state = JobState("pw", 1, 1, {"dp": 1, "tp": 1, "pp": 1}, run_dir=str(tmp_path))
    server = _job_redis(parallel, state, False, tmp_path)
    try:
        with pytest.raises(redis.AuthenticationError):  # another local user, on loopback
            redis.Redis(port=port).set("megascale/pw/0/addr", "10.6.6.6")
        assert redis.Redis(port=port, password=(tmp_path / "redis_password").read_text()).ping()
    finally:
        server.stop()
