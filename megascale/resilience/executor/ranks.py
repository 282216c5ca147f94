"""A node's rank processes, as its executor sees them: warm standbys, assigned ranks, their pipes.

Every rank starts as a standby forked by the node's standby server, `megascale train
--standby-server` (a fixed command line; no argument comes from the driver), which loaded
Python, torch and megascale once (`resilience/rank/forks.py`). The executor hands a standby its
rank through its stdin (`Assign`: the config file, the environment, the log) and keeps `wanted`
standbys ready, so a replacement costs a pipe write, not a process start and seconds of imports.
The server is started from the executor's command thread only: its `PR_SET_PDEATHSIG` fires
when the thread that started it ends, and that one lives as long as the executor.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale.config.private_files import open_private
from megascale.config.schema import REDIS_PASSWORD_ENV
from megascale.resilience.rank.forks import ForkedProcess, ForkServer

SECRET_ENV = (REDIS_PASSWORD_ENV,)  # never passed on to ranks or self-checks
SERVER_ARGV = (sys.executable, "-m", "megascale.cli", "train", "--standby-server")


@dataclass
class RankProcess:
    rank: int
    local_rank: int
    proc: ForkedProcess
    log_path: Path
    offset: int = 0  # how far the log has been scanned for keywords
    partial: bytes = b""
    exited_at: float | None = None  # set by `watch_exit`: when its server reaped it

    def send(self, message: dict[str, Any]) -> bool:
        """One message on the rank's stdin; False if the rank is gone."""
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def watch_exit(self) -> None:
        """The moment the rank ends (heartbeats see it up to a second later): the driver blames
        the first rank to die, and peers die within milliseconds of it."""

        def wait() -> None:
            self.proc.wait()
            self.exited_at = self.proc.exited_at

        threading.Thread(target=wait, daemon=True).start()


class StandbyPool:
    """The node's forked rank processes, each waiting on its stdin for an assignment."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.wanted = 0
        self._ready: list[ForkedProcess] = []
        self._made = 0
        self._server: ForkServer | None = None  # started with the first standby

    def top_up(self) -> None:
        """Fork standbys until `wanted` are alive (call from the command thread)."""
        self._ready = [p for p in self._ready if p.poll() is None]
        while len(self._ready) < self.wanted:
            self._ready.append(self._fork())

    def take(self) -> ForkedProcess:
        """A warm process if one is ready, else a new one (forked once the server is up)."""
        self._ready = [p for p in self._ready if p.poll() is None]
        return self._ready.pop(0) if self._ready else self._fork()

    def _fork(self) -> ForkedProcess:
        env = rank_environment()
        env.setdefault("OMP_NUM_THREADS", "1")
        if self._server is None or not self._server.alive():
            if self._server is not None:
                self._server.close()
            out = open_private(self.workdir / "standby-server.log")
            try:
                self._server = ForkServer(SERVER_ARGV, env, out)
            finally:
                os.close(out)
        self._made += 1
        out = open_private(self.workdir / f"standby{self._made:04d}.log")  # until it writes its rank's log
        try:
            return self._server.fork(env, out)
        finally:
            os.close(out)


def rank_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV}


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
