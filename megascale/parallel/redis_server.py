"""Start a private redis-server on a free loopback port (tests, benchmarks, local runs).

The driver or launcher uses this when `parallel.store = "redis"` and no server is given; tests
use it so that each session gets its own server and never touches a shared one.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import redis

from megascale.parallel.launch import free_port


class RedisServer:
    """A redis-server child process without persistence; `url` is ready once started."""

    def __init__(self, port: int | None = None, startup_timeout_s: float = 10.0) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError(
                "redis-server is not installed (Debian: apt-get install -y redis-server; "
                "scripts/install_system_deps.sh does it)"
            )
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self) -> RedisServer:
        self._dir = tempfile.TemporaryDirectory(prefix="megascale-redis-")
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                "--maxclients",
                "20000",
                "--tcp-backlog",
                "4096",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError as exc:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    err = self._proc.stderr.read().decode() if self._proc.poll() is not None else ""
                    self.stop()
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not start: {err or exc}"
                    ) from exc
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
