"""Load that is no attack on any one rule but could still end a job: a flood of sockets that
never show a token. The executors' heartbeats must keep being answered well inside the heartbeat
timeout (the driver serves connections that hold the token first; see api_server.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import ssl
import statistics
import threading
import time

import pytest

from megascale.resilience.common.api import ApiClient
from megascale.resilience.driver.api_server import Limits
from tests.security import flood
from tests.security.live import LiveDriver, attacker_tls, raw_request, read_response, request_bytes

pytestmark = pytest.mark.timeout(180)
FLOOD = 3000


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    live = LiveDriver(
        tmp_path_factory.mktemp("load") / "run", fd_limit=8192, request_timeout_s=10.0, peer_check=True
    )  # the defaults
    try:
        yield live
    finally:
        live.close()


@pytest.mark.slow
def test_3000_idle_connections_without_a_token_cost_the_node_no_heartbeat(driver):
    """3,000 sockets (one in ten through the TLS handshake) opened as fast as this process can
    and left idle past the 5 s heartbeat timeout: the node's heartbeats (every 0.5 s) are
    answered throughout with no gap near the timeout, the driver holds no more than its cap of
    such connections (512: today it held every one, a TLS transport each), and the job is untouched."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, FLOOD + 512)), hard))
    time.sleep(1.0)
    began = time.monotonic()
    idle = []
    try:
        for i in range(FLOOD):
            with contextlib.suppress(OSError):  # closed by the driver (a flood it sheds): the attack goes on
                idle.append(
                    attacker_tls(driver.port)
                    if i % 10 == 0
                    else socket.create_connection(("127.0.0.1", driver.port), timeout=5)
                )
        held = len(os.listdir(f"/proc/{driver.proc.pid}/fd"))
        time.sleep(6.0)
        ended = time.monotonic()
    finally:
        for sock in idle:
            sock.close()
    beats = [t for t in driver.node.answered if began - 1.0 <= t <= ended]
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    assert beats and max(gaps) < 2.5, (len(beats), max(gaps, default=None))
    assert ended - beats[-1] < 2.5
    assert held < Limits().max_unauthenticated + 100, held
    driver.untouched()
    assert "connections without a token yet: closed the oldest" in driver.log()


@pytest.mark.serial  # the victim's pace is timed: at load 44 beside the other workers it missed
def test_a_flood_from_one_peer_costs_that_peer_not_the_others(driver):
    """A node with its own credential (node-b, from 127.0.0.2) pipelines maximum-size valid
    heartbeats over 100 connections for 10 s, while 127.0.0.3 floods handshakes with a wrong
    token, both from their own processes. node-a (127.0.0.1) keeps heartbeating every 0.5 s:
    its beats keep their pace (the median interval between answers under twice what it was in
    the 4 s before, on the machine as loaded as it is) and are never more than 4 s apart
    (the heartbeat timeout is 5 s; the slack is for a loaded machine), the operator's status
    (its kept-alive connection) is answered within 4 s throughout, and node-b's flood is served
    no more than its budget (burst + rate x the flood's time, in requests of its size).
    Without the budgets (their use in api_server.py reverted; load average 6.6-11.4) node-a had
    4-5 beats answered in 10 s, a median interval of 1.4-1.9 s (0.51 s with them, 18 beats), the
    largest 3.2-3.6 s (so that bound alone passed at low load; at load 20 it was 5.5 s), node-b
    34-65 heavy heartbeats served (10 with them) and the driver 9.4-12.4 CPU s (2.5). The pace
    against the 4 s before: 2.4-2.9x without the budgets at load 21-37 (one run at 1.9x, caught
    by the 4 s bound: 8.5 s), 1.1-1.4x with them at load 30-38."""
    time.sleep(4.0)  # node-a's pace before the flood, on this machine as loaded as it is now
    node_b = ApiClient.for_run(driver.run_dir, operator=False)
    credential = node_b.call(
        "POST", "/v1/register", {"node_id": "node-b", "address": "127.0.0.1", "host": "flood", "pid": 1}
    )["credential"]
    rank = {"rank": 0, "local_rank": 0, "pid": 1, "alive": True, "step": 1, "recent": [[1, 0.1]] * 64}
    body = json.dumps({"node_id": "node-b", "ranks": [dict(rank, rank=i) for i in range(1024)]}).encode()
    heavy = request_bytes("POST", "/v1/heartbeat", body, token=credential)
    wrong = request_bytes("GET", "/v1/status", token="w" * 43)
    assert len(heavy) > 700_000
    latencies: list[float] = []

    def operator() -> None:
        client = ApiClient.for_run(driver.run_dir)  # kept alive, as an operator's script keeps it
        while time.monotonic() < stop_at:
            started = time.monotonic()
            client.status()
            latencies.append(time.monotonic() - started)
            time.sleep(0.5)

    began = time.monotonic()
    before = _intervals(driver.node.answered, began - 4.0, began)
    stop_at = began + 10.0
    floods = [
        flood.start(driver.port, "127.0.0.2", heavy, 100, 10.0, pipelined=2),
        flood.start(driver.port, "127.0.0.3", wrong, 20, 10.0),
    ]
    watcher = threading.Thread(target=operator, daemon=True)
    watcher.start()
    heavy_seen, wrong_seen = (flood.result(proc) for proc in floods)
    flood_s = time.monotonic() - began
    watcher.join(10)
    gaps = _intervals(driver.node.answered, began, stop_at)
    pace = statistics.median(gaps) / statistics.median(before)
    seen = (len(gaps) - 1, max(gaps), pace, statistics.median(before), heavy_seen, wrong_seen, os.getloadavg())
    assert pace < 2.0 and max(gaps) < 4.0, seen
    budget = Limits().budget
    served = sum(n for status, n in heavy_seen.items() if status not in ("429", "dropped"))
    assert served <= (budget.burst + budget.rate * flood_s) / (1 + len(body) / budget.unit_bytes) + 1, seen
    assert latencies and max(latencies) < 4.0, latencies
    assert heavy_seen.get("429", 0) > 0 and wrong_seen.get("401", 0) > 0, (heavy_seen, wrong_seen)
    status = driver.status()  # node-b, a spare silent since its flood, may be evicted as lost by now
    assert (status["phase"], status["attempt"], status["faults"]) == ("running", 0, []), status
    assert status["nodes"]["node-a"]["role"] == "active" and driver.node.refused == [], driver.node.refused
    assert "429 POST /v1/heartbeat from 127.0.0.2" in driver.log()


def _intervals(answered: list[float], start: float, end: float) -> list[float]:
    """The intervals between answered beats in [start, end], the two ends included as beats."""
    beats = [start, *(t for t in answered if start <= t <= end), end]
    return [b - a for a, b in zip(beats, beats[1:], strict=False)]


def test_a_node_registers_only_the_address_it_connects_from(driver):
    """The address a node registers becomes every attempt's MASTER_ADDR when it is the first
    active node: a join-token holder claiming another host's address is refused, from loopback
    and from 127.0.0.2 alike; the address it does connect from is admitted."""
    body = {"node_id": "node-c", "host": "x", "pid": 1}
    for address in ("10.66.0.1", "127.0.0.2", "0:0:0:0:0:ffff:a42:1"):  # the last: 10.66.0.1 as IPv6
        status, reply = raw_request(
            driver.port,
            request_bytes("POST", "/v1/register", json.dumps({**body, "address": address}).encode(), driver.join_token),
        )
        assert status == 403 and "connects from 127.0.0.1" in reply["error"], (address, status, reply)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    for address, expected in (("127.0.0.1", 403), ("127.0.0.2", 200)):
        sock = socket.create_connection(("127.0.0.1", driver.port), source_address=("127.0.0.2", 0))
        with ctx.wrap_socket(sock) as tls:
            tls.sendall(
                request_bytes(
                    "POST", "/v1/register", json.dumps({**body, "address": address}).encode(), driver.join_token
                )
            )
            assert read_response(tls)[0] == expected, address
    status = driver.status()
    assert status["nodes"]["node-c"]["address"] == "127.0.0.2" and status["master"]["addr"] == "127.0.0.1"
    assert (status["phase"], status["attempt"], status["faults"]) == ("running", 0, [])


def test_requests_whose_clients_left_are_dropped_unrun_and_the_queue_is_bounded(tmp_path):
    """One handler thread, held busy: 20 clients send a request and leave, 12 more wait for
    their answer. The 20 are never run once the handler is free (today every one ran, after
    its client had gone), at most `max_pending` are queued and the rest get a 503 at once."""
    from megascale.resilience.common.credentials import ensure_secret, load_secret, server_context
    from megascale.resilience.driver.api_server import ApiServer, Route
    from megascale.resilience.driver.identity import OPERATOR, Identities
    from tests.security.live import request_bytes

    secret = load_secret(ensure_secret(tmp_path / "secret", ["127.0.0.1"]), need_key=True)
    gate, ran = threading.Event(), []

    def handler(body: dict, who) -> tuple[int, dict]:
        ran.append(time.monotonic())
        gate.wait(20)
        return 200, {"ok": True}

    routes = {("GET", "/v1/x"): Route(handler, callers=frozenset({OPERATOR}))}
    server = ApiServer(
        "127.0.0.1",
        0,
        Identities(secret, "j").authenticate,
        routes,
        server_context(secret),
        Limits(handler_threads=1, max_pending=8),
    ).start()
    request = request_bytes("GET", "/v1/x", token=secret.operator)
    try:
        first = attacker_tls(server.port)
        first.sendall(request)
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(20):  # sent, then the client gives up
            with attacker_tls(server.port) as sock:
                sock.sendall(request)
                time.sleep(0.02)
        time.sleep(0.5)
        waiting = []
        for _ in range(12):
            sock = attacker_tls(server.port, timeout_s=30)
            sock.sendall(request)
            waiting.append(sock)
        time.sleep(0.5)
        gate.set()
        statuses = [_status(sock) for sock in waiting]
        first.close()
        for sock in waiting:
            sock.close()
    finally:
        gate.set()
        server.close()
    assert len(ran) <= 1 + 8, len(ran)  # the first, and no more than the queue held of the waiting ones
    assert statuses.count(503) >= 12 - 8 and statuses.count(200) >= 1, statuses


def _status(sock) -> int:
    """The status of the response on `sock` (its head is enough; a kept-alive answer never ends)."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split()[1])
