"""Helpers to run the multi-process gloo workload (tests/diagnostics/workload.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.parallel.store import free_port

WORKLOAD = Path(__file__).with_name("workload.py")


class Workload:
    """The ranks of one workload run, started as real processes."""

    def __init__(self, run_dir: Path, layout: tuple[int, int, int], *extra: str) -> None:
        self.world = layout[0] * layout[1] * layout[2]
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="64")
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKLOAD),
                    "--rank",
                    str(r),
                    "--world",
                    str(self.world),
                    "--port",
                    str(port),
                    "--run-dir",
                    str(run_dir),
                    "--layout",
                    ",".join(map(str, layout)),
                    *extra,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for r in range(self.world)
        ]

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for r, p in enumerate(self.procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"workload rank {r} did not finish in {timeout} s")
            assert p.returncode == 0, f"rank {r} failed:\n{out.decode()[-3000:]}"

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)


@pytest.fixture(scope="session")
def workload_cls() -> type[Workload]:
    """The class, for module-scoped fixtures that start one run shared by several tests."""
    return Workload


@pytest.fixture
def workload():
    started: list[Workload] = []

    def start(run_dir: Path, layout: tuple[int, int, int], *extra: str) -> Workload:
        w = Workload(run_dir, layout, *extra)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()
