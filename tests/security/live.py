"""A live driver on loopback with one simulated node, for attacks to be aimed at.

The driver is the real `megascale launch --external` process (no training: the node is this
test's own client, speaking the protocol with the real `ApiClient`, heartbeating every 0.5 s
from a thread). It runs with a lowered descriptor limit, a Redis password in its URL and a short
request timeout, so that attacks on all of these are quick; the check of registered addresses
against the connection's is off unless asked for (`peer_check`). `untouched()` is the job as it must
stay: running, attempt 0, no fault, the node active, the node's heartbeats all answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from megascale.resilience.common.api import ApiClient, ApiError

REPO = Path(__file__).resolve().parents[2]
REDIS_PASSWORD = "hunter2-redis-password-in-the-url"
NODE = "node-a"
FD_LIMIT = 512
REQUEST_TIMEOUT_S = 1.0


class LiveDriver:
    def __init__(
        self,
        run_dir: Path,
        fd_limit: int = FD_LIMIT,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        peer_check: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.run_dir = run_dir
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = run_dir.parent / "driver.log"
        args = [
            sys.executable,
            "-m",
            "megascale.cli",
            "launch",
            "--external",
            "--nodes",
            "1",
            "--ranks-per-node",
            "1",
            "--parallel.dp=1",
            "--train.steps=1000000",
            "--parallel.store=redis",
            f"--parallel.redis_url=redis://:{REDIS_PASSWORD}@127.0.0.1:1/0",
            "--resilience.hang_floor_s=3600",
            "--resilience.heartbeat_timeout_s=5",
            "--resilience.startup_timeout_s=3600",
            f"--resilience.api_request_timeout_s={request_timeout_s}",
            f"--train.run_dir={run_dir}",
            # the attacks claim addresses (10.x, 127.0.0.2) from this one process on 127.0.0.1
            f"--resilience.peer_address_check={str(peer_check).lower()}",
            *extra,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit)),
            )
        deadline = time.monotonic() + 60
        while not (run_dir / "resilience" / "driver.json").is_file():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.05)
        self.client = ApiClient.for_run(run_dir)  # the operator's
        self.token = self.client.token  # the operator token
        self.join_token = ApiClient.for_run(run_dir, operator=False).token  # what every executor holds
        self.port = int(self.client.url.rsplit(":", 1)[1])
        self.node = SimulatedNode(ApiClient.for_run(run_dir, operator=False))
        self.node.start()
        self.wait_for(lambda s: s["phase"] == "running" and self.node.start_command is not None)

    def client_as(self, credential: str) -> ApiClient:
        """A client that presents `credential` (the node's, the join token, the operator's)."""
        client = ApiClient.for_run(self.run_dir)
        client.token = credential
        return client

    def as_node(self) -> ApiClient:
        return self.client_as(self.node.credential)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        return self.client.status()

    def wait_for(self, predicate, timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if predicate(status):
                return status
            assert time.monotonic() < deadline and self.proc.poll() is None, (status, self.log()[-3000:])
            time.sleep(0.05)

    def untouched(self) -> None:
        """The driver alive and answering a valid request, the job exactly as it was."""
        assert self.proc.poll() is None, self.log()[-3000:]
        s = ApiClient.for_run(self.run_dir).status()  # on a fresh connection
        assert (s["phase"], s["attempt"], s["restarts"], s["faults"], s["evicted"]) == ("running", 0, 0, [], []), s
        assert s["nodes"][NODE]["role"] == "active" and s["nodes"][NODE]["last_seen_s"] < 3, s
        assert self.node.refused == [], self.node.refused

    def close(self) -> None:
        self.node.stop()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class SimulatedNode(threading.Thread):
    """An executor's side of the protocol without ranks: one rank 'trains' a step per heartbeat
    once the driver sent it a `start` (a spare never gets one)."""

    def __init__(self, client: ApiClient, node_id: str = NODE, address: str = "127.0.0.1") -> None:
        super().__init__(name=f"simulated-{node_id}", daemon=True)
        self.client, self.step, self.done = client, 0, threading.Event()
        self.node_id, self.address = node_id, address
        self.registered = threading.Event()
        self.start_command: dict[str, Any] | None = None
        self.results: dict[str, Any] = {}
        self.refused: list[str] = []  # heartbeats the driver answered with an error
        self.answered: list[float] = []  # when each heartbeat's answer came (monotonic)
        self.credential = ""

    def run(self) -> None:
        reply = self.client.call(
            "POST",
            "/v1/register",
            {"node_id": self.node_id, "address": self.address, "host": "simulated", "pid": os.getpid()},
        )
        self.client.token = self.credential = reply["credential"]  # as the executor does
        self.registered.set()
        while not self.done.wait(0.5):
            try:
                reply = self.client.call("POST", "/v1/heartbeat", self.heartbeat())
            except ApiError as exc:
                self.refused.append(str(exc))
                continue
            except OSError:
                continue  # a connection lost in a flood: the next beat tries again
            self.answered.append(time.monotonic())
            for command in reply["commands"]:
                if command["kind"] == "start":
                    self.start_command = command
                self.results[command["id"]] = {"ok": True, "pids": [os.getpid()]}
            for command_id in reply["ack"]:
                self.results.pop(command_id, None)

    def heartbeat(self) -> dict[str, Any]:
        self.step += 1
        rank = {
            "rank": 0,
            "local_rank": 0,
            "pid": os.getpid(),
            "alive": True,
            "step": self.step,
            "step_time": 0.1,
            "recent": [[self.step, 0.1]],
        }
        return {
            "node_id": self.node_id,
            "seq": self.step,
            "time": time.time(),
            "address": self.address,
            "host": "simulated",
            "attempt": 0 if self.start_command else None,
            "ranks": [rank] if self.start_command else [],
            "net_shared": True,
            "done": dict(self.results),
        }

    def stop(self) -> None:
        self.done.set()
        self.join(5)


def attacker_tls(port: int, timeout_s: float = 5.0, rcvbuf: int | None = None) -> ssl.SSLSocket:
    """A TLS connection as an attacker makes it: no certificate checked, nothing else known;
    `rcvbuf` bytes of receive buffer (set before connecting, so the window is that small)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout_s)
    sock.connect(("127.0.0.1", port))
    return ctx.wrap_socket(sock)


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one response, read until the server closes the connection."""
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    return int(head.split()[1]), json.loads(body or b"{}")


def raw_request(port: int, raw: bytes, timeout_s: float = 5.0) -> tuple[int, dict[str, Any]]:
    with attacker_tls(port, timeout_s) as sock:
        sock.sendall(raw)
        return read_response(sock)


def request_bytes(
    method: str, path: str, body: bytes = b"", token: str | None = None, headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: driver", f"Content-Length: {len(body)}"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
