"""The API server on its own: a route with `inline_lock` (the heartbeat) is answered on the loop
thread while that lock is free and waits in the handler pool while someone holds it; requests are
framed as HTTP/1.1 says, whatever a client sends (pipelined, asking to close, a head without end,
answers never read)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from megascale.resilience.common.credentials import ensure_secret, load_secret, server_context
from megascale.resilience.driver.api_budget import Budget
from megascale.resilience.driver.api_server import ApiServer, Limits, Route
from megascale.resilience.driver.identity import OPERATOR, Identities
from tests.security.live import attacker_tls, request_bytes

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served(tmp_path):
    secret = load_secret(ensure_secret(tmp_path / "secret", ["127.0.0.1"]), need_key=True)
    lock, threads = threading.RLock(), []

    def beat(body: dict, who) -> tuple[int, dict]:
        with lock:  # as the driver's handlers take the driver's lock
            threads.append(threading.current_thread().name)
        return 200, {"ok": True}

    operator = frozenset({OPERATOR})
    routes = {
        ("GET", "/v1/beat"): Route(beat, callers=operator, inline_lock=lock),
        ("GET", "/v1/other"): Route(lambda body, who: (200, {"ok": True}), callers=operator),
    }
    limits = Limits(budget=Budget(rate=1e6, burst=1e6))  # the budgets are not what is tested here
    server = ApiServer("127.0.0.1", 0, Identities(secret, "j").authenticate, routes, server_context(secret), limits)
    server.start()
    try:
        yield server, secret.operator, lock, threads
    finally:
        server.close()


def _statuses(sock, count: int) -> list[int]:
    """The statuses of the next `count` responses on a kept-alive connection."""
    data = b""
    while data.count(b"HTTP/1.1 ") < count:
        chunk = sock.recv(65536)
        assert chunk, data[-200:]
        data += chunk
    return [int(part.split()[0]) for part in data.split(b"HTTP/1.1 ")[1:]]


def test_a_free_lock_answers_on_the_loop_thread_and_a_held_one_in_the_pool(served):
    server, token, lock, threads = served
    with attacker_tls(server.port) as sock:
        sock.sendall(request_bytes("GET", "/v1/beat", token=token))
        assert _statuses(sock, 1) == [200] and threads == ["driver-api"]

    lock.acquire()  # the control loop's tick, say
    try:
        waiting = attacker_tls(server.port, timeout_s=10)
        waiting.sendall(request_bytes("GET", "/v1/beat", token=token))
        time.sleep(0.3)
        with attacker_tls(server.port) as other:  # the loop is not stuck behind the lock
            other.sendall(request_bytes("GET", "/v1/other", token=token))
            assert _statuses(other, 1) == [200]
        assert len(threads) == 1
    finally:
        lock.release()
    assert _statuses(waiting, 1) == [200] and threads[1].startswith("api-handler")
    waiting.close()


def test_pipelined_inline_requests_are_answered_without_recursion(served):
    """1,500 requests in one write: each inline answer comes from the loop's next round, so the
    requests behind it are not parsed one stack frame deeper each (that raised RecursionError)."""
    server, token, _, threads = served
    with attacker_tls(server.port, timeout_s=30) as sock:
        sock.sendall(request_bytes("GET", "/v1/beat", token=token) * 1500)
        assert _statuses(sock, 1500) == [200] * 1500
    assert set(threads) == {"driver-api"}


def test_the_drivers_heartbeat_route_is_the_inline_one(tmp_path):
    """The driver's API as `megascale launch` builds it: heartbeats inline on the driver's own
    lock (the one its control loop and every handler take); the other routes go to the pool."""
    from megascale.resilience.driver.cli import _routes
    from tests.resilience.test_recovery import started_driver

    driver, _ = started_driver(tmp_path)
    secret = load_secret(ensure_secret(tmp_path / "secret", ["127.0.0.1"]), need_key=True)
    routes = _routes(driver, Identities(secret, "j"), None)
    assert routes[("POST", "/v1/heartbeat")].inline_lock is driver.lock
    assert [path for (_, path), route in routes.items() if route.inline_lock is not None] == ["/v1/heartbeat"]


def test_pipelined_requests_are_answered_in_order_and_a_refusal_ends_them(served):
    """Two good requests, one with a forged token, one more good one, in one write: the two are
    answered, then the refusal, and the connection closes (the fourth is never run)."""
    server, token, _, threads = served
    good = request_bytes("GET", "/v1/beat", token=token)
    with attacker_tls(server.port) as sock:
        sock.sendall(good * 2 + request_bytes("GET", "/v1/beat", token="forged") + good)
        assert _statuses(sock, 3) == [200, 200, 401]
        assert sock.recv(65536) == b""
    assert len(threads) == 2


def test_a_request_that_asks_to_close_is_answered_then_closed(served):
    server, token, _, _ = served
    with attacker_tls(server.port) as sock:
        sock.sendall(request_bytes("GET", "/v1/other", token=token, headers={"Connection": "close"}))
        assert _statuses(sock, 1) == [200]
        assert sock.recv(65536) == b""


def test_a_head_streamed_without_end_is_refused_at_the_cap(served):
    """One header that never ends, sent in pieces: the parser gathers a header before it calls
    back, so the server counts the head's bytes itself and refuses past the cap, not at the end."""
    server, token, _, threads = served
    with attacker_tls(server.port) as sock:
        sock.sendall(request_bytes("GET", "/v1/beat", token=token)[:-2] + b"X-Endless: ")
        with contextlib.suppress(OSError):  # the server hangs up past the cap
            for _ in range(64):
                sock.sendall(b"a" * 1024)
        assert _statuses(sock, 1) == [431]
    assert threads == []


def test_a_client_that_never_reads_its_answers_is_stopped_at_the_write_buffer(served):
    """Requests pipelined without end, answers never read: once the connection's write buffer
    is full the server answers no more, and with nothing answered it reads no more, so the
    client's sends block at what the sockets' kernel buffers hold (megabytes on loopback), not
    after the 64 MB it tries to send; meanwhile another client is answered at once."""
    server, token, _, threads = served
    one = request_bytes("GET", "/v1/beat", token=token)
    burst, total, sent = one * ((1 << 20) // len(one)), 64 << 20, 0
    # a small receive buffer: the answers back up sooner; a send that moves nothing for 3 s raises
    with attacker_tls(server.port, timeout_s=3.0, rcvbuf=1 << 16) as sock:
        with contextlib.suppress(TimeoutError):
            while sent < total:
                sock.sendall(burst)
                sent += len(burst)
        assert sent < total / 2, f"{sent >> 20} MB sent: the server read on while its answers were unread"
        answered = len(threads)
        time.sleep(1.0)
        assert len(threads) == answered > 0  # stopped, not answering slowly
        with attacker_tls(server.port) as other:
            other.sendall(one)
            assert _statuses(other, 1) == [200]
