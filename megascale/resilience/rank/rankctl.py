"""A rank's side of the pipe its executor holds: the assignment, `abort` and `rejoin`.

Ranks under an executor start as standby processes (`megascale train --standby`: Python, torch
and megascale already imported) and read JSON lines on their stdin, which only their executor
can write: no port is opened and nothing else can command them. Every line is checked against
its schema (`protocol.RANK_MESSAGE`); a malformed one is refused with a line on stderr.

`abort` must work while the training thread is blocked inside a collective whose peer is dead
or unreachable, which gloo cannot abort (`ProcessGroup.abort` leaves a waiting operation
waiting). So the reader thread shuts down every established TCP connection of the process: each
pending operation fails at once with "connection closed", the training thread unwinds, and the
process groups are dropped. NCCL's communicators are aborted by the caller as well
(`ParallelMesh.abort`), as TCP says nothing about what waits on the GPU.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import socket
import sys
import threading
from collections.abc import Iterator

import psutil
from pydantic import ValidationError

from megascale.resilience.common.protocol import RANK_MESSAGE, Assign, Rejoin, first_error

# what a collective raises when a peer is gone (gloo, NCCL, the stores, the node's data ring)
PEER_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Socket Timeout|timed out|Timed out|NCCL communicator was aborted"
    r"|ProcessGroup.*(aborted|destroyed)|data reader \(pid \d+\) died|local rank reading shared batches .* died"
)


class RankControl:
    """Reads the executor's messages on a thread; `next()` hands over assignments and rejoins."""

    def __init__(self, fd: int = 0) -> None:
        self.aborted = threading.Event()
        self._messages: queue.Queue[Assign | Rejoin | None] = queue.Queue()
        self._fd = fd
        threading.Thread(target=self._read, name="megascale-rank-control", daemon=True).start()

    def next(self) -> Assign | Rejoin | None:
        """The next assignment or rejoin; None once the executor closed the pipe (it is gone)."""
        message = self._messages.get()
        if message is not None:
            self.aborted.clear()
        return message

    def _lines(self) -> Iterator[bytes]:
        """Lines read with os.read: no buffered file object whose lock a blocked daemon thread
        would hold when the interpreter shuts down (Python aborts on that)."""
        pending = b""
        while chunk := os.read(self._fd, 1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            yield from lines

    def _read(self) -> None:
        for line in self._lines():
            try:
                message = RANK_MESSAGE.validate_json(line)
            except ValidationError as exc:
                print(
                    f"megascale: refused a malformed message from the executor: {first_error(exc)}",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            if message.kind == "abort":
                self.aborted.set()
                sever_connections()
            else:
                self._messages.put(message)
        self._messages.put(None)


def sever_connections() -> int:
    """Shut down every established TCP connection of this process (both directions): whatever
    waits on one fails now. The descriptors stay with their owners, who close them."""
    severed = 0
    for conn in psutil.Process().net_connections(kind="inet"):
        if conn.status != psutil.CONN_ESTABLISHED or conn.fd < 0 or conn.type != socket.SOCK_STREAM:
            continue
        with contextlib.suppress(OSError):
            dup = socket.socket(fileno=os.dup(conn.fd))  # shutdown acts on the socket, not the descriptor
            try:
                dup.shutdown(socket.SHUT_RDWR)
                severed += 1
            finally:
                dup.close()
    return severed


def is_peer_failure(exc: BaseException, aborted: bool) -> bool:
    """Did this rank stop because a peer failed (or the executor said so), not because of itself?"""
    if aborted:
        return True
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if PEER_FAILURE.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
