"""A rank's side of its executor's pipe (issue 20): messages checked by schema, and an `abort` that
frees a thread blocked on a connection whose peer will never answer (what gloo's own abort
cannot do), on real sockets and a real pipe."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

from megascale.resilience.rank.rankctl import is_peer_failure

ASSIGN = (
    '{"kind": "assign", "config": "/w/attempt0/rank/config.toml", "log": "/w/attempt0/rank00001.log", '
    '"env": {"RANK": "1", "WORLD_SIZE": "4", "MEGASCALE_RESTART_ATTEMPT": "0"}}'
)

# A thread waits in recv() on a connection to a peer that is alive but silent (a SIGSTOPped rank,
# a cut link); the executor's `abort` arrives on the pipe; the wait must end at once. Run in its
# own process: the abort shuts down every TCP connection of the process it runs in.
SCRIPT = textwrap.dedent("""
    import os, socket, sys, threading, time
    from megascale.resilience.rank.rankctl import RankControl

    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())
    silent, _ = server.accept()                       # the peer: holds the connection, never sends
    read, write = os.pipe()
    control = RankControl(read)
    ended = []
    waiter = threading.Thread(target=lambda: ended.append(peer.recv(1)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()                          # blocked, as a collective waiting on a peer
    os.write(write, b'{"kind": "bogus"}\\n' + sys.argv[1].encode() + b'\\n')
    assigned = control.next()                         # the standby becomes rank 1 and trains...
    os.write(write, b'{"kind": "abort"}\\n')          # ...until a peer fails
    started = time.monotonic()
    waiter.join(5)
    print(type(assigned).__name__, assigned.env["RANK"], control.aborted.is_set(), ended,
          round(time.monotonic() - started, 1) < 2.0)
    os.close(write)
    print(control.next())                             # the executor closed the pipe: None
""")


def test_abort_frees_a_wait_on_a_silent_peer_and_messages_are_checked():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, ASSIGN],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["Assign 1 True [b''] True", "None"], out.stdout
    assert "refused a malformed message from the executor: " in out.stderr  # the bogus line, named


def test_a_peer_s_failure_is_told_from_the_rank_s_own_error():
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4711")
    wrapped = RuntimeError("checkpoint agreement failed")
    wrapped.__cause__ = closed
    assert is_peer_failure(closed, aborted=False) and is_peer_failure(wrapped, aborted=False)
    assert is_peer_failure(TimeoutError("Socket Timeout"), aborted=False)
    own = RuntimeError("injected failure on rank 2 at step 7")
    assert not is_peer_failure(own, aborted=False)
    assert is_peer_failure(own, aborted=True)  # the executor said abort: whatever it raised is that
    assert not is_peer_failure(socket.gaierror("name or service not known"), aborted=False)
