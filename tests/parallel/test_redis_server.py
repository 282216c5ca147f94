"""`parallel.redis_start`: the launcher and the driver run the job's redis-server, safely."""

import time

import pytest
import redis
from cli_train import train_cli

from megascale.config import ConfigError, JobConfig, ParallelConfig, to_dict
from megascale.config.schema import REDIS_PASSWORD_ENV, redacted_url
from megascale.parallel.redis_store import RedisStore, StoreUnreachableError, delete_prefix
from megascale.parallel.store import StoreAddress, attempt_prefix, create_store, free_port
from megascale.resilience.common.redis_server import RedisServer
from megascale.resilience.driver.driver import Driver
from megascale.resilience.driver.state import ACTIVE, JobState, JobStore, Node

pytestmark = pytest.mark.redis


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"store": "tcp"}, 'needs parallel.store = "redis"'),
        ({"redis_url": "unix:///tmp/r.sock"}, "must be redis://HOST:PORT/DB with a port"),
        ({"redis_url": "redis://10.0.0.5:6379/0"}, "10.0.0.5:6379 without a password"),
    ],
)
def test_redis_start_refuses_unsafe_or_unusable_settings(fields, message):
    cfg = ParallelConfig(**{"store": "redis", "redis_start": True, **fields})
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_a_password_protected_server_refuses_strangers_and_logs_no_secret():
    with RedisServer(password="s3cret") as server:
        assert server.url.startswith("redis://:s3cret@127.0.0.1:")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).set("k", "v")
        store = RedisStore(server.url, prefix="p/")
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert oct(server.config_path.stat().st_mode & 0o777) == "0o600"
    assert redacted_url(server.url) == f"redis://:***@127.0.0.1:{server.port}/0"
    with pytest.raises(StoreUnreachableError) as err:
        RedisStore(server.url, connect_timeout_s=1)  # stopped: the error must not show the password
    assert "s3cret" not in str(err.value) and ":***@" in str(err.value)


@pytest.mark.slow
def test_launcher_serves_redis_for_the_job_and_stops_it(tmp_path):
    """`megascale train --nproc 2` with redis_start: the ranks rendezvous on the server the
    launcher started (they would fail to reach the address otherwise), which is gone after."""
    port = free_port()
    proc, _ = train_cli(
        tmp_path,
        "redis",
        [
            "--nproc",
            "2",
            "--parallel.dp=2",
            "--parallel.store='redis'",
            "--parallel.redis_start=true",
            f"--parallel.redis_url='redis://127.0.0.1:{port}/0'",
        ],
    )
    assert "store=redis" in proc.stdout + proc.stderr
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=1).ping()


def test_driver_clears_the_previous_attempts_keys(tmp_path, redis_server):
    job = "clearjob"
    for attempt in (0, 1):
        RedisStore(redis_server.url, prefix=attempt_prefix(job, attempt)).set("addr", b"x")
    cfg = JobConfig(parallel=ParallelConfig(store="redis", redis_url=redis_server.url))
    state = JobState(job, 1, 1, {"dp": 1, "tp": 1, "pp": 1}, run_dir=str(tmp_path), attempt=1)
    state.nodes["n0"] = Node("n0", "127.0.0.1", "h", ACTIVE, 0)
    driver = Driver(cfg, state, JobStore(tmp_path / "s.sqlite"))
    driver._start_attempt(time.time())
    assert driver.background.drain(60)
    keys = redis.Redis.from_url(redis_server.url)
    assert keys.exists(attempt_prefix(job, 0) + "addr") == 0
    assert keys.exists(attempt_prefix(job, 1) + "addr") == 1
    assert delete_prefix(redis_server.url, f"megascale/{job}/") == 1


def test_a_restarted_driver_adopts_the_jobs_server(tmp_path):
    """The driver's server outlives a driver crash; its successor takes it over, not a second."""
    from megascale.resilience.driver.cli import _alive, _job_redis

    port = free_port()
    parallel = ParallelConfig(store="redis", redis_start=True, redis_url=f"redis://127.0.0.1:{port}/0")
    state = JobState("adopt", 1, 1, {"dp": 1, "tp": 1, "pp": 1}, run_dir=str(tmp_path))
    first = _job_redis(parallel, state, False, tmp_path)
    try:
        pid = state.api["redis_pid"]
        assert first.pid == pid and first.answers()
        second = _job_redis(parallel, state, True, tmp_path)  # the first driver "crashed": no stop()
        assert second.pid == pid and state.api["redis_pid"] == pid
        second.stop()  # the job ended under the second driver
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid) and not second.answers()
    finally:
        first.stop()


def test_a_port_held_by_another_server_is_an_error_not_a_silent_success():
    with RedisServer() as other:
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{other.port} did not start"):
            RedisServer(port=other.port).start()
        assert other.answers()


def test_password_from_the_environment_stays_out_of_urls_and_written_configs(monkeypatch):
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "envsecret")
    port = free_port()
    cfg = ParallelConfig(store="redis", redis_start=True, redis_url=f"redis://127.0.0.1:{port}/0")
    with RedisServer.for_job(cfg) as server:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        store = create_store(cfg, 0, 1, StoreAddress("127.0.0.1", 1, "envjob", 0))
        store.set("k", b"v")
        assert store.clear() == 1
        assert server.answers()
    written = to_dict(JobConfig(parallel=ParallelConfig(redis_url="redis://:urlsecret@10.0.0.5:6379/0")))
    assert written["parallel"]["redis_url"] == "redis://:***@10.0.0.5:6379/0"
