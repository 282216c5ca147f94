"""free_port: a port for a server started a moment later, out of the way of port-0 picks."""

import socket

import pytest

from megascale.parallel import store
from megascale.parallel.store import free_port


def test_the_port_is_below_the_range_outgoing_connections_and_port_0_draw_from():
    low, _ = store._ephemeral_range()
    if low <= store._FIRST_PORT:
        pytest.skip(f"this machine's ephemeral range starts at {low}: no room below it")
    held = []
    try:
        for _ in range(200):  # what other tests' listeners and connections take meanwhile
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        drawn = {s.getsockname()[1] for s in held}
        picks = {free_port() for _ in range(200)}
    finally:
        for s in held:
            s.close()
    assert all(store._FIRST_PORT <= p < low for p in picks), sorted(picks)[:5]
    assert not picks & drawn


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(store._RANDOM, "sample", lambda ports, k: [busy, busy])
        port = free_port()  # every candidate taken: the kernel's pick
        assert port != busy
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
