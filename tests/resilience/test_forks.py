"""The standby fork server: children get their own stdin, log, session and environment, their
exits are reported as Popen would, and they never outlive the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megascale.resilience.rank.forks import ForkServer

# A child reads its stdin to the end, prints its environment's X and exits with what it read.
SERVER = (
    sys.executable,
    "-c",
    "import os, socket, sys\n"
    "from megascale.resilience.rank.forks import serve_forks\n"
    "def child():\n"
    "    data = b''\n"
    "    while chunk := os.read(0, 100):\n"
    "        data += chunk\n"
    "    print('X=' + os.environ.get('X', '?') + ' sid=' + str(os.getsid(0)), flush=True)\n"
    "    return int(data or b'0')\n"
    "sys.exit(serve_forks(socket.socket(fileno=0), child))\n",
)


@pytest.fixture
def server(tmp_path):
    log = os.open(tmp_path / "server.log", os.O_WRONLY | os.O_CREAT, 0o600)
    started = ForkServer(SERVER, dict(os.environ), log)
    os.close(log)
    yield started
    started.close()
    started.proc.kill()
    started.proc.wait()


def fork(server: ForkServer, tmp_path, name: str, env: dict[str, str]):
    log = os.open(tmp_path / f"{name}.log", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        return server.fork({**os.environ, **env}, log)
    finally:
        os.close(log)


def test_a_child_has_its_stdin_log_session_and_environment_and_its_exit_is_reported(server, tmp_path):
    first = fork(server, tmp_path, "a", {"X": "one"})
    second = fork(server, tmp_path, "b", {"X": "two"})
    assert psutil.Process(first.pid).ppid() == server.proc.pid
    assert first.poll() is None and second.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(0.2)  # alive: it waits on its stdin
    second.stdin.write(b"3")
    second.stdin.close()
    assert second.wait(30) == 3 and first.poll() is None
    assert second.exited_at is not None and abs(second.exited_at - time.time()) < 30
    first.stdin.write(b"0")
    first.stdin.close()
    assert first.wait(30) == 0
    assert (tmp_path / "a.log").read_text() == f"X=one sid={first.pid}\n"  # a session of its own
    assert (tmp_path / "b.log").read_text() == f"X=two sid={second.pid}\n"


def test_a_killed_child_reports_its_signal(server, tmp_path):
    child = fork(server, tmp_path, "a", {})
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL


def test_children_die_with_the_server_and_their_handles_say_so(server, tmp_path):
    children = [fork(server, tmp_path, f"c{i}", {}) for i in range(2)]
    server.proc.kill()
    for child in children:
        assert child.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while psutil.pid_exists(child.pid) and psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"{child.pid} outlived its server"
            time.sleep(0.05)
    assert not server.alive()
    with pytest.raises(OSError):  # a broken pipe, or no answer
        fork(server, tmp_path, "late", {})


def test_the_servers_warm_up_never_asks_cuda(monkeypatch):
    """`torch.cuda.is_available()` initialises the CUDA driver, and no fork of a process that did
    can use the GPU: the warm-up every standby inherits must not call it."""
    import torch

    from megascale.train import worker

    def poisoned() -> bool:
        raise AssertionError("the standby server initialised CUDA: its forks could not use the GPU")

    monkeypatch.setattr(torch.cuda, "is_available", poisoned)
    monkeypatch.setattr(torch.cuda, "device_count", poisoned)
    worker.warm_up()
