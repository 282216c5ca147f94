"""Standby ranks forked from one warm process: a replacement rank costs a fork, not a process start.

An executor keeps warm standby ranks (`executor/ranks.py`). Started one by one, each paid
Python's start, torch's imports and the warm-up: 6-9 s of CPU on a loaded 2-core machine, and
~300 MB of memory shared with nothing. Instead the executor starts one fork server per node
(`megascale train --standby-server`), which pays that once and forks a standby per request.
The children share the server's pages until they write them.

Both ends are here: `serve_forks` (the server's loop) and `ForkServer` (the executor's client).
A request is one datagram on a Unix socket: the environment the standby runs with, and two
descriptors passed with it, the standby's stdin (the executor keeps the pipe's write end) and
its log. The server answers with the child's pid once the child is in a session of its own (so
that signalling its group never misses it). It is the children's parent: it reaps them at
once (SIGCHLD wakes it) and reports each exit status and time, which `ForkedProcess` answers as
`subprocess.Popen` would (`poll`, `wait`, `returncode`).

Lifetimes: the server dies with the executor's command thread (PR_SET_PDEATHSIG, set by the
executor), each standby with the server; a standby runs in a session of its own, so the
executor signals its process group as before. The server must never initialise CUDA: a child
forked from a process that has cannot use it. It imports and warms up the CPU only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

MAX_MESSAGE = 1 << 20  # an environment of a few KB; a request past this is a bug
READY_TIMEOUT_S = 30.0  # a child's setsid and prctl, before its pid is answered
START_TIMEOUT_S = 300.0  # the server's imports, on a loaded machine, before it answers the first request
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """The calling process gets SIGKILL when the thread that forked it ends."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# ---------------------------------------------------------------------- the server (its own process)
def serve_forks(sock: socket.socket, child_main: Callable[[], int]) -> int:
    """Fork a standby per request until the executor closes the socket. In a child this returns
    `child_main()`'s exit code (its stdin, log and environment set before); in the server, 0 once
    the executor is gone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears it
    children: set[int] = set()
    me = os.getpid()
    requests = sock.fileno()
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock, children)
        if requests not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        if not message:
            return 0  # the executor is gone; the children follow (PR_SET_PDEATHSIG)
        sys.stdout.flush()
        sys.stderr.flush()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the standby: it returns from here, and exits as any process would
            sock.close()  # fd 0: the standby's stdin goes there
            for fd in (wake_r, wake_w, ready_r):
                os.close(fd)
            _become_standby(fds, json.loads(message)["env"], me)
            os.close(ready_w)  # its own session now: the executor may signal its group
            return child_main()
        for fd in (*fds, ready_w):
            os.close(fd)
        select.select([ready_r], [], [], READY_TIMEOUT_S)  # EOF: set up, or dead (and reported)
        os.close(ready_r)
        children.add(pid)
        sock.send(json.dumps({"pid": pid}).encode())


def _become_standby(fds: Sequence[int], env: dict[str, str], server: int) -> None:
    """The child's half of the fork: its own stdin, log, session and environment; gone with the server."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    stdin, log = fds
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    os.setsid()
    die_with_parent()
    if os.getppid() != server:  # the server died before the line above
        os._exit(1)
    os.environ.clear()
    os.environ.update(env)


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            sock.send(json.dumps({"exited": pid, "code": code, "at": time.time()}).encode())


# ---------------------------------------------------------------------- the client (in the executor)
class ForkedProcess:
    """A standby forked by the server, with the part of `subprocess.Popen` the executor uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = None
        self.returncode: int | None = None
        self.exited_at: float | None = None  # the server's clock when it reaped the process
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"standby {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def end(self, code: int, at: float) -> None:
        self.returncode, self.exited_at = code, at
        self._ended.set()


class ForkServer:
    """The executor's side: starts the server, asks it for standbys, hears of their ends."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], log_fd: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdin=theirs.fileno(),
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request, and its answer, at a time
        self._forked: queue.Queue[ForkedProcess | None] = queue.Queue()
        self._children: dict[int, ForkedProcess] = {}
        threading.Thread(target=self._listen, name="executor-fork-server", daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, env: dict[str, str], log_fd: int) -> ForkedProcess:
        """A new standby whose stdin is a pipe from here and whose output goes to `log_fd`."""
        read_end, write_end = os.pipe()
        child = None
        try:
            with self._lock:
                socket.send_fds(self._sock, [json.dumps({"env": env}).encode()], [read_end, log_fd])
                with contextlib.suppress(queue.Empty):
                    child = self._forked.get(timeout=START_TIMEOUT_S)
        finally:
            os.close(read_end)
            if child is None:
                os.close(write_end)
        if child is None:
            raise OSError(f"the standby fork server (pid {self.proc.pid}) did not fork: see its log")
        child.stdin = os.fdopen(write_end, "wb")
        return child

    def _listen(self) -> None:
        while True:
            try:
                message = self._sock.recv(MAX_MESSAGE)
            except OSError:
                message = b""
            if not message:
                break
            reply = json.loads(message)
            if "pid" in reply:
                child = ForkedProcess(reply["pid"])
                self._children[child.pid] = child
                self._forked.put(child)
            else:
                self._children.pop(reply["exited"]).end(reply["code"], reply["at"])
        # the server is gone, and its children with it (PR_SET_PDEATHSIG)
        self._forked.put(None)
        for child in self._children.values():
            child.end(-signal.SIGKILL, time.time())
        self._children.clear()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
