"""Attacks on a live driver over loopback: every one is refused with the right 4xx and a log line,
and afterwards the driver still answers a valid request and the job is exactly as it was.

One driver for the module (tests/security/live.py); it runs with a descriptor limit of 512, so
the connection flood below is also the descriptor-exhaustion attack.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import stat
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from megascale.resilience.common import protocol
from megascale.resilience.common.api import ApiClient, ApiError
from megascale.resilience.common.protocol import PLAN_ENV, RANK_ENV
from tests.security.live import (
    NODE,
    REDIS_PASSWORD,
    REQUEST_TIMEOUT_S,
    LiveDriver,
    attacker_tls,
    raw_request,
    read_response,
    request_bytes,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # a live driver under attack


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    live = LiveDriver(tmp_path_factory.mktemp("live") / "run")
    try:
        yield live
    finally:
        live.close()


def test_requests_without_a_valid_bearer_token_are_refused_and_logged(driver):
    token = driver.token
    for header in (
        None,
        "",
        "Bearer",
        "Bearer ",
        f"Basic {token}",
        f"Token {token}",
        token,
        f"Bearer {token[:-1]}",
        f"Bearer {token}x",
        f"Bearer  {token[:20]}",
    ):
        extra = {} if header is None else {"Authorization": header}
        status, body = raw_request(driver.port, request_bytes("POST", "/v1/stop", b"{}", headers=extra))
        assert status == 401 and "token" in body["error"], (header, status, body)
    for path in ("/v1/evict", "/v1/status", "/nothing"):  # no route is probed without the token
        assert raw_request(driver.port, request_bytes("POST", path, b"{}"))[0] == 401
    driver.untouched()
    assert "api: 401 POST /v1/stop from 127.0.0.1" in driver.log()


def test_malformed_bodies_from_a_token_holder_get_a_400_naming_the_defect(driver):
    beat = driver.node.heartbeat()
    bad = {
        "ranks: Input should be a valid array": {**beat, "ranks": "abc"},
        "ranks.0: Input should be an object": {**beat, "ranks": ["abc"]},
        "ranks.0.rank: Input should be a valid integer": {**beat, "ranks": [{**beat["ranks"][0], "rank": "0"}]},
        "ranks.0.step: Input should be greater than or equal to 0": {
            **beat,
            "ranks": [{**beat["ranks"][0], "step": -1}],
        },
        "done.x.[key]: String should match pattern": {**beat, "done": {"x": {"ok": True}}},
        "attempt: Input should be a valid integer": {**beat, "attempt": "0"},
        "errors.0.text: Input should be a valid string": {**beat, "errors": [{"rank": 0, "text": 5}]},
        "node_id: String should match pattern": {**beat, "node_id": "node-a\nFAULT forged log line"},
        "sneaky: Extra inputs are not permitted": {**beat, "sneaky": 1},
        "body: Input should be an object": [beat],
    }
    node = driver.as_node()
    for expected, body in bad.items():
        with pytest.raises(ApiError) as err:
            node.call("POST", "/v1/heartbeat", body)
        assert err.value.status == 400 and expected in str(err.value), (expected, err.value)
    for raw in (
        b'"a string"',
        b"[" * 5000 + b"]" * 5000,
        b'{"node_id": "node-a", "time": NaN}',
        b'{"node_id": "node-a", "time": 1e400}',
        b"\xff\xfe not json",
        b"{" * 100_000,
    ):
        status, body = raw_request(driver.port, request_bytes("POST", "/v1/heartbeat", raw, driver.node.credential))
        assert status == 400 and body["error"].startswith("bad request"), (raw[:40], status, body)
    for path, body in (
        ("/v1/evict", {"node_id": 5}),
        ("/v1/evict", {}),
        ("/v1/stop", {"reason": ["x"]}),
        ("/v1/register", {"node_id": NODE}),
        ("/v1/stop", {"reason": "x", "also": 1}),
    ):
        with pytest.raises(ApiError) as err:
            (node if path == "/v1/register" else driver.client).call("POST", path, body)
        assert err.value.status == 400, (path, body)
    status, _ = raw_request(driver.port, request_bytes("GET", "/v1/status", b'{"x": 1}', driver.token))
    assert status == 400  # a route without a body refuses one
    driver.untouched()
    assert "api: 400 POST /v1/heartbeat" in driver.log() and "Traceback" not in driver.log()


def test_a_body_announced_but_never_sent_does_not_hold_the_driver(driver):
    head = (
        f"POST /v1/heartbeat HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {driver.node.credential}\r\n"
        "Content-Length: 1000\r\n\r\n"
    ).encode()
    stalled = [attacker_tls(driver.port) for _ in range(20)]
    for sock in stalled:
        sock.sendall(head + b'{"node_id"')  # 10 of the 1000 bytes promised
    slowloris = attacker_tls(driver.port)
    slowloris.sendall(b"POST /v1/stop HTTP/1.1\r\nHost: d\r\nX-Slow: ")  # half a header
    started = time.monotonic()
    assert driver.status()["phase"] == "running"  # served while they wait
    assert time.monotonic() - started < 1.0
    for sock in [*stalled, slowloris]:
        status, body = read_response(sock)
        assert status == 408 and "not complete" in body["error"]
        sock.close()
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 3
    driver.untouched()


def _one_response(sock: socket.socket) -> int:
    """The status of one response on a kept-alive connection (read to its content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1])


def test_a_kept_alive_request_has_the_whole_timeout_from_its_first_byte(driver):
    # CI: a node's heartbeat, sent 0.5 s into the 1 s idle window in two writes (head, body), got a
    # 408 when the body came late: the request's time was counted from the last answer
    request = request_bytes("GET", "/v1/status", token=driver.token)
    head, rest = request[:20], request[20:]
    with attacker_tls(driver.port) as sock:
        sock.sendall(request)
        assert _one_response(sock) == 200
        time.sleep(0.7 * REQUEST_TIMEOUT_S)  # idle, kept alive
        sock.sendall(head)
        time.sleep(0.6 * REQUEST_TIMEOUT_S)  # 1.3 timeouts after the answer, 0.6 into the request
        sock.sendall(rest)
        assert _one_response(sock) == 200
    driver.untouched()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"POST /v1/heartbeat HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer TOKEN\r\nContent-Length: -5\r\n\r\n", 400),
        (
            b"POST /v1/heartbeat HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer TOKEN\r\n"
            b"Content-Length: 100000000\r\n\r\n",
            413,
        ),
        (b"GET /v1/status HTTP/1.1\r\nHost: d\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
    ],
)
def test_impossible_lengths_and_oversized_heads_are_refused_at_once(driver, raw, status):
    started = time.monotonic()
    assert raw_request(driver.port, raw.replace(b"TOKEN", driver.node.credential.encode()))[0] == status
    assert time.monotonic() - started < REQUEST_TIMEOUT_S / 2  # no waiting for a body
    driver.untouched()


def test_a_100_mb_body_is_cut_off_at_the_cap(driver):
    sock = attacker_tls(driver.port)
    sock.sendall(
        (
            f"POST /v1/heartbeat HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {driver.node.credential}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
    )
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    with contextlib.suppress(OSError):  # the driver hangs up after the cap; the rest is refused
        for _ in range(100):
            sock.sendall(chunk)
    status, body = read_response(sock)
    assert status == 413 and "exceeds" in body["error"]
    driver.untouched()


def test_a_thousand_idle_connections_do_not_starve_heartbeats_or_requests(driver):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    count = min(1000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 200)
    cpu_before = _cpu_seconds(driver.proc.pid)
    idle = []
    try:
        # TLS-completed and half-requests (one in ten), then plain TCP, all left idle. The plain
        # ones go last and at once: on a loaded machine the handshakes take seconds, and opened
        # among them the plain sockets expired (1 s request timeout) before the cap was reached.
        for i in range(0, count, 10):
            sock = attacker_tls(driver.port)
            if i % 20 == 0:
                sock.sendall(b"GET /v1/status HTTP/1.1\r\n")
            idle.append(sock)
        idle += [socket.create_connection(("127.0.0.1", driver.port), timeout=5) for _ in range(count - len(idle))]
        # what is timed is service beside idle connections, not the burst's accepts
        _settled(driver.proc.pid, driver.port)
        latencies = []
        for _ in range(10):
            started = time.monotonic()
            ApiClient.for_run(driver.run_dir).status()  # a new connection each time
            latencies.append(time.monotonic() - started)
        time.sleep(1.5)  # the node heartbeats throughout
        assert max(latencies) < 2.0, latencies
        assert _cpu_seconds(driver.proc.pid) - cpu_before < 4.0  # answering, not spinning
        assert len(os.listdir(f"/proc/{driver.proc.pid}/fd")) < 512  # under its descriptor limit
    finally:
        for sock in idle:
            sock.close()
    driver.untouched()
    assert "closed the oldest idle one" in driver.log() and "Too many open files" not in driver.log()


def _settled(pid: int, port: int, timeout_s: float = 20.0) -> None:
    """Until the driver has taken its whole backlog and its descriptor count holds still for
    0.2 s. The count alone is not enough: at the connection cap every accept closes an idle
    connection, so it holds still while hundreds still wait to be accepted (beside six CPU hogs
    it returned with 80-208 queued). A loaded full run timed its first request at 3.1 s, most
    likely queued behind them."""
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        now = len(os.listdir(f"/proc/{pid}/fd"))
        if now == last and _accept_queue(port) == 0:
            return
        last = now
        time.sleep(0.2)


def _accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the socket listening on `port` (for a
    listening socket, /proc/net/tcp's rx_queue is that queue's length)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                return int(fields[4].split(":")[1], 16)  # tx_queue:rx_queue
    raise AssertionError(f"no socket listens on port {port}")


def test_files_are_private_and_hold_no_secret(driver):
    run = driver.run_dir
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "resilience").stat().st_mode) == 0o700
    private = [p for p in run.rglob("*") if p.is_file()]
    assert {p.name for p in private} >= {"driver.sqlite", "driver.sqlite-wal", "driver.json", "token", "tls.key"}
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert REDIS_PASSWORD.encode() not in path.read_bytes(), path
    log = driver.log()
    assert REDIS_PASSWORD not in log and driver.token not in log and driver.join_token not in log
    assert driver.node.credential not in log
    assert REDIS_PASSWORD.encode() not in Path(f"/proc/{driver.proc.pid}/environ").read_bytes()


def test_ranks_get_a_config_text_and_the_password_apart_never_argv(driver):
    command = driver.node.start_command
    assert set(command) == {"id", "kind", "attempt", "ranks", "env", "plan_env", "config", "redis_password", "keep"}
    assert command["keep"] == []  # the first attempt: no paused rank rejoins
    assert set(command["env"]) <= set(RANK_ENV) and set(command["plan_env"]) <= set(PLAN_ENV)
    assert command["redis_password"] == REDIS_PASSWORD  # inside TLS, to be written to a 0600 file
    assert REDIS_PASSWORD not in command["config"] and "redis://127.0.0.1:1/0" in command["config"]
    assert 'run_dir = "' in command["config"] and "save_on_signal = false" in command["config"]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- property-based fuzzing
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)


def _mutations(valid: dict, nested: str | None = None) -> st.SearchStrategy:
    """Random JSON, or `valid` with one field replaced by random JSON, dropped, or one added."""
    keys = sorted(valid)
    out = [
        JSON,
        st.builds(lambda k, v: {**valid, k: v}, st.sampled_from(keys), JSON),
        st.builds(lambda k: {x: y for x, y in valid.items() if x != k}, st.sampled_from(keys)),
        st.builds(lambda k, v: {**valid, k: v}, st.text(min_size=1, max_size=8), JSON),
    ]
    if nested:
        inner = valid[nested][0]
        out.append(st.builds(lambda k, v: {**valid, nested: [{**inner, k: v}]}, st.sampled_from(sorted(inner)), JSON))
    return st.one_of(out)


def _refused(schema, body) -> bool:
    try:
        schema.model_validate_json(json.dumps(body))
    except (ValidationError, ValueError):
        return True
    return False


@pytest.mark.parametrize("path", ["/v1/register", "/v1/heartbeat", "/v1/evict", "/v1/stop"])
def test_fuzzed_bodies_get_a_400_and_change_nothing(driver, path):
    schema = {
        "/v1/register": protocol.Register,
        "/v1/heartbeat": protocol.Heartbeat,
        "/v1/evict": protocol.Evict,
        "/v1/stop": protocol.Stop,
    }[path]
    valid = {
        "/v1/register": {"node_id": NODE, "address": "127.0.0.1", "host": "simulated", "pid": 1},
        "/v1/heartbeat": driver.node.heartbeat(),
        "/v1/evict": {"node_id": NODE, "reason": "fuzz"},
        "/v1/stop": {"reason": "fuzz"},
    }[path]
    client = driver.client_as(
        {"/v1/register": driver.join_token, "/v1/heartbeat": driver.node.credential}.get(path, driver.token)
    )

    @settings(
        max_examples=50,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
    )
    @given(_mutations(valid, "ranks" if path == "/v1/heartbeat" else None))
    def refused_with_400(body):
        assume(body is not None and _refused(schema, body))  # a valid body would register, evict or stop
        with pytest.raises(ApiError) as err:
            client.call("POST", path, body)
        assert err.value.status == 400 and "bad request" in str(err.value)

    refused_with_400()
    driver.untouched()
