"""Fixtures for the parallel tests: a private redis-server for the Redis store tests."""

import shutil

import pytest

from megascale.resilience.common.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server on a free loopback port for this session; skips if it is not installed."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/install_system_deps.sh installs it)")
    with RedisServer() as server:
        yield server
