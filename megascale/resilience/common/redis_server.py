"""A redis-server for one job: started by the launcher or the driver, or privately by tests.

With `parallel.store = "redis"` and `parallel.redis_start = true`, `megascale train --nproc N`
and `megascale launch` start redis-server at `parallel.redis_url`'s host and port for the job's
lifetime. A Redis store outlives rank 0, which the TCPStore does not. Tests and benchmarks use
`RedisServer()` on a free loopback port so that each session has its own server.

A server bound beyond loopback must require a password ($MEGASCALE_REDIS_PASSWORD, or in the
URL): it goes into a config file readable only by us, never onto the command line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from urllib.parse import urlsplit

import redis

from megascale.config import ParallelConfig
from megascale.parallel.store import free_port


class RedisServer:
    """A redis-server child process without persistence; `url` is ready once started."""

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError(
                "redis-server is not installed (Debian: apt-get install -y redis-server; "
                "scripts/install_system_deps.sh does it)"
            )
        self.host, self.port, self.password = host, port or free_port(), password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}{host}:{self.port}/0"
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._adopted: int | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self.config_path: Path | None = None  # holds the password: private to this user

    @classmethod
    def for_job(cls, cfg: ParallelConfig) -> RedisServer:
        """The server `parallel.redis_start` asks for, at `redis_url`'s host and port (not started)."""
        parts = urlsplit(cfg.redis_url)
        return cls(port=parts.port, host=parts.hostname or "127.0.0.1", password=cfg.redis_password())

    def start(self) -> RedisServer:
        self._dir = tempfile.TemporaryDirectory(prefix="megascale-redis-")  # mode 0700
        conf = self.config_path = Path(self._dir.name) / "redis.conf"
        settings = {
            "port": self.port,
            "bind": self.host,
            "save": '""',
            "appendonly": "no",
            "dir": self._dir.name,
            "logfile": "redis.log",  # relative to dir; read back when the server fails to start
            "maxclients": 20000,
            "tcp-backlog": 4096,
        }
        if self.password:
            settings["requirepass"] = self.password
        conf.write_text("".join(f"{k} {v}\n" for k, v in settings.items()))
        conf.chmod(0o600)
        self._proc = subprocess.Popen([self.binary, str(conf)], cwd=self._dir.name, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + self._startup_timeout_s
        while not self.answers(self._proc.pid):  # ours: another server may hold the port
            if self._proc.poll() is not None or time.monotonic() > deadline:
                log_file = Path(self._dir.name) / "redis.log"
                tail = log_file.read_text().strip().splitlines()[-3:] if log_file.exists() else []
                self.stop()
                raise RuntimeError(
                    f"redis-server on {self.host}:{self.port} did not start: {' / '.join(tail) or 'no answer'}"
                )
            time.sleep(0.05)
        return self

    def adopt(self, pid: int) -> RedisServer:
        """Take over a server a previous driver started (same address); `stop` will end it."""
        if not self.answers(pid):
            raise RuntimeError(f"redis-server pid {pid} does not answer at {self.host}:{self.port}; cannot adopt it")
        self._adopted = pid
        return self

    def answers(self, pid: int | None = None) -> bool:
        """Whether a server answers at our address (and, given `pid`, is that process)."""
        client = redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_connect_timeout=1, socket_timeout=5
        )
        try:
            info = client.info("server")  # raises when nobody answers
            return pid is None or int(info["process_id"]) == pid
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        finally:
            client.close()

    @property
    def pid(self) -> int:
        """The server's process id (benchmarks read its CPU time; a restarted driver adopts it)."""
        if self._proc is not None:
            return self._proc.pid
        if self._adopted is not None:
            return self._adopted
        raise RuntimeError("redis-server is not running; call start() first")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._adopted is not None:
            with suppress(ProcessLookupError):
                os.kill(self._adopted, signal.SIGTERM)
        self._proc = self._adopted = self.config_path = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
