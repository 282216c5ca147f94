"""A node's rank processes, as its executor sees them: warm standbys, assigned ranks, their pipes.

Every rank starts as `megascale train --standby` (the fixed command line; no argument comes
from the driver): Python, torch and megascale load while it waits, and the executor hands it a
rank through its stdin (`Assign`: the config file, the environment, the log). The executor
keeps `wanted` such processes ready, so a replacement costs a pipe write, not a process start
and seconds of imports. Processes are started from the executor's command thread only: their
`PR_SET_PDEATHSIG` fires when the thread that forked them ends, and that one lives as long as
the executor.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale.config.private_files import open_private
from megascale.config.schema import REDIS_PASSWORD_ENV

SECRET_ENV = (REDIS_PASSWORD_ENV,)  # never passed on to ranks or self-checks
STANDBY_ARGV = (sys.executable, "-m", "megascale.cli", "train", "--standby")


@dataclass
class RankProcess:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    log_path: Path
    offset: int = 0  # how far the log has been scanned for keywords
    partial: bytes = b""
    exited_at: float | None = None  # set by `watch_exit`

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
            self.exited_at = time.time()

        threading.Thread(target=wait, daemon=True).start()


class StandbyPool:
    """The node's pre-started rank processes, each waiting on its stdin for an assignment."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.wanted = 0
        self._ready: list[subprocess.Popen] = []
        self._made = 0

    def top_up(self) -> None:
        """Start standbys until `wanted` are alive (call from the command thread)."""
        self._ready = [p for p in self._ready if p.poll() is None]
        while len(self._ready) < self.wanted:
            self._ready.append(self._spawn())

    def take(self) -> subprocess.Popen:
        """A warm process if one is ready, else a new one (which takes its assignment once loaded)."""
        self._ready = [p for p in self._ready if p.poll() is None]
        return self._ready.pop(0) if self._ready else self._spawn()

    def _spawn(self) -> subprocess.Popen:
        self._made += 1
        out = open_private(self.workdir / f"standby{self._made:04d}.log")  # until it writes its rank's log
        env = rank_environment()
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            return subprocess.Popen(
                STANDBY_ARGV,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            os.close(out)


def rank_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV}


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _die_with_parent() -> None:
    """A rank never outlives its executor (as on a real node that goes down with it)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
