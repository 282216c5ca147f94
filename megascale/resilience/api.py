"""The driver's small HTTP API, and the client executors and operators use.

Every request carries `Authorization: Bearer <token>` (compared in constant time); the server
binds to loopback unless configured otherwise. Executors only make outbound calls (register,
heartbeat; commands come back in the reply), so a node behind NAT or in a pod needs no port.

    POST /v1/register   executor -> driver   {node_id, address, host, pid}
    POST /v1/heartbeat  executor -> driver   the node's report; reply {commands: [...]}
    GET  /v1/status     operator             job state, nodes, faults, alerts, ETTR so far
    POST /v1/evict      operator             {node_id, reason}: stop, evict, resume
    POST /v1/stop       operator             stop the job (ranks killed, executors exit)
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

Handler = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def load_or_create_token(token: str, path: Path) -> str:
    """The configured token, else the one in `path`, else a new one written there (0600)."""
    if token:
        return token
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


class ApiServer:
    """Routes (method, path) to handlers that take the JSON body and return (status, JSON)."""

    def __init__(self, host: str, port: int, token: str, routes: dict[tuple[str, str], Handler]):
        self.token, self.routes = token, routes
        server = self

        class Request(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep the driver's log readable
                pass

            def _serve(self, method: str) -> None:
                given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                if not hmac.compare_digest(given.encode(), server.token.encode()):
                    return self._reply(401, {"error": "missing or wrong token"})
                route = server.routes.get((method, self.path.split("?")[0]))
                if route is None:
                    return self._reply(404, {"error": f"no route {method} {self.path}"})
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                    status, reply = route(body)
                except (ValueError, KeyError) as exc:
                    status, reply = 400, {"error": f"bad request: {exc}"}
                self._reply(status, reply)

            def _reply(self, status: int, data: dict[str, Any]) -> None:
                raw = json.dumps(data, default=str).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(raw)  # else the caller gave up waiting; it will ask again

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

        ThreadingHTTPServer.allow_reuse_address = True
        self.httpd = ThreadingHTTPServer((host, port), Request)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="driver-api",
                                        daemon=True)

    def start(self) -> ApiServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class ApiClient:
    def __init__(self, url: str, token: str, timeout_s: float = 5.0) -> None:
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                message = str(exc.reason)
            raise ApiError(exc.code, message) from None

    def status(self) -> dict[str, Any]:
        return self.call("GET", "/v1/status")
