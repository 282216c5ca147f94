"""Node ids bound to hosts by a roster (`resilience.roster`, roster.py), on a live driver over
loopback: 127.0.0.1-3 stand for three hosts. Without a roster, any join-token holder could
register any id the job expected before its real node did (trust on first use); with one, a
listed id registers only from its host, an unlisted one only as a name of the address it comes
from and only within `resilience.spare_pool`, and each refusal is a 403 that says why.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import sys

import pytest

from megascale.config import ConfigError
from megascale.resilience.driver.roster import load_roster
from tests.security.live import REPO, LiveDriver, read_response, request_bytes

pytestmark = pytest.mark.timeout(120)
ROSTER = "node-a 127.0.0.1  # the live driver's own node\nnode-b 127.0.0.2\nnode-c 127.0.0.3\n"


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    root = tmp_path_factory.mktemp("roster")
    (root / "roster").write_text(ROSTER)
    live = LiveDriver(
        root / "run",
        peer_check=True,
        extra=(f"--resilience.roster=file:{root / 'roster'}", "--resilience.spare_pool=1"),
    )
    try:
        yield live
    finally:
        live.close()


def register_from(driver: LiveDriver, source: str, node_id: str) -> tuple[int, dict]:
    """A registration with the join token (what every node holds) from `source`, of its own address."""
    body = {"node_id": node_id, "address": source, "host": "x", "pid": 1}
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    sock = socket.create_connection(("127.0.0.1", driver.port), source_address=(source, 0), timeout=10)
    with ctx.wrap_socket(sock) as tls:
        tls.sendall(request_bytes("POST", "/v1/register", json.dumps(body).encode(), driver.join_token))
        return read_response(tls)


def test_a_listed_node_id_registers_only_from_its_host(driver):
    status, reply = register_from(driver, "127.0.0.2", "node-c")  # a node taking another's id first
    assert status == 403 and "node-c is bound to 127.0.0.3 by the job's roster" in reply["error"], reply
    assert "comes from 127.0.0.2" in reply["error"], reply
    assert "node-c" not in driver.status()["nodes"]
    status, first = register_from(driver, "127.0.0.3", "node-c")  # the real node-c is admitted
    assert status == 200, first
    # its executor restarted without the credential it was given (a new work directory, a
    # resubmitted job): its host is its proof, from there alone
    assert register_from(driver, "127.0.0.2", "node-c")[0] == 403
    status, again = register_from(driver, "127.0.0.3", "node-c")
    assert status == 200 and again["credential"] == first["credential"], again
    driver.untouched()
    assert "api: 403 POST /v1/register from 127.0.0.2" in driver.log()


def test_an_id_off_the_roster_must_name_its_host_and_fits_the_pool(driver):
    status, reply = register_from(driver, "127.0.0.2", "squatter")
    assert status == 403 and "squatter is not on the job's roster" in reply["error"], reply
    assert "resolves to the address it connects from (127.0.0.2)" in reply["error"], reply
    assert register_from(driver, "127.0.0.3", "127.0.0.2")[0] == 403  # a name of another host
    assert register_from(driver, "127.0.0.2", "127.0.0.2")[0] == 200  # a replacement node: its own name
    status, reply = register_from(driver, "127.0.0.3", "127.0.0.3")  # the pool (1) is used up
    assert status == 403 and "the most this job admits (resilience.spare_pool = 1)" in reply["error"], reply
    assert register_from(driver, "127.0.0.2", "node-b")[0] == 200  # the roster's own ids still join
    nodes = driver.status()["nodes"]
    assert {"node-a", "node-b", "127.0.0.2"} <= set(nodes) and "squatter" not in nodes, sorted(nodes)
    driver.untouched()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "lists no node"),
        ("node-a 10.0.0.1 extra\n", "line 1: 'node-a 10.0.0.1 extra': expected `NODE_ID [HOST]`"),
        ("n1\nn1 h\n", "line 2"),
        ("bad/id\n", "line 1"),
    ],
)
def test_a_malformed_roster_is_a_clear_error(tmp_path, text, message):
    (tmp_path / "roster").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_roster(f"file:{tmp_path / 'roster'}")
    assert load_roster("") is None


def test_a_roster_the_driver_cannot_read_stops_it_before_it_listens(tmp_path):
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "launch",
            "--external",
            f"--train.run_dir={tmp_path / 'run'}",
            f"--resilience.roster=file:{tmp_path / 'missing'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert launch.returncode == 2 and "resilience.roster=" in launch.stderr and "cannot read it" in launch.stderr
    assert not (tmp_path / "run" / "resilience" / "driver.json").exists()
