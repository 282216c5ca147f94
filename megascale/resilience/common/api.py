"""The driver's HTTPS API, and the client executors and operators use.

Every request carries `Authorization: Bearer <credential>` (compared in constant time) inside TLS:
the operator token, the join token (registration), or the node's own credential (`identity.py`);
the client accepts only the job's own certificate (pinned from the secret directory, see
`credentials.py`), so the token never reaches a server that does not hold the driver's key.
The server (`api_server.py`) binds to loopback unless configured otherwise. Executors only make
outbound calls (register, heartbeat; commands come back in the reply), so a node behind NAT or
in a pod needs no open port. Bodies are checked against `protocol.py` on receipt.

    POST /v1/register   executor -> driver   {node_id, address, host, pid}; reply has its credential
    POST /v1/heartbeat  executor -> driver   the node's report (its credential); reply {commands: [...]}
    GET  /v1/status     operator             job state, nodes, faults, alerts, ETTR so far
    POST /v1/evict      operator             {node_id, reason}: stop, evict, resume
    POST /v1/stop       operator             stop the job (ranks killed, executors exit)
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from megascale.resilience.common.credentials import load_secret, pinned_context

MAX_REPLY = 64 << 20


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class UntrustedDriver(ConnectionError):
    """The server at the driver's address does not hold the job's certificate: nothing was sent."""


class ApiClient:
    """Calls the driver over one kept-alive TLS connection that trusts only `cert_pem`."""

    def __init__(self, url: str, token: str, cert_pem: bytes, timeout_s: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError(f"driver URL {url!r} must be https://HOST:PORT (the API is served over TLS only)")
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self._host, self._port = parts.hostname, parts.port or 443
        self._ctx = pinned_context(cert_pem)
        self._pin = ssl.PEM_cert_to_DER_cert(cert_pem.decode())
        self._conn: http.client.HTTPSConnection | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, run_dir: str | Path, timeout_s: float = 5.0, operator: bool = True) -> ApiClient:
        """The operator's client of the driver serving RUN_DIR (from its driver.json and secret
        directory); `operator=False`: an executor's, with the join token."""
        info = json.loads((Path(run_dir) / "resilience" / "driver.json").read_text())
        secret = load_secret(info["secret_dir"], need_key=False, operator=operator)
        return cls(info["url"], secret.operator if operator else secret.token, secret.cert_pem, timeout_s)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        with self._lock:
            for last_try in (False, True):
                reused = self._conn is not None
                conn = self._connection()
                try:
                    conn.request(method, path, body=data, headers=headers)
                    resp = conn.getresponse()
                    raw = resp.read(MAX_REPLY + 1)
                    break
                except (OSError, http.client.HTTPException) as exc:
                    self.close()
                    if last_try or not reused:  # a kept-alive connection the driver closed: retry once
                        raise ConnectionError(f"{self.url}{path}: {exc!r}") from exc
            if resp.will_close or len(raw) > MAX_REPLY:
                self.close()
        if len(raw) > MAX_REPLY:
            raise ConnectionError(f"{self.url}{path}: reply larger than {MAX_REPLY} bytes")
        try:
            reply = json.loads(raw or b"{}")
        except ValueError:
            raise ConnectionError(f"{self.url}{path}: HTTP {resp.status} reply is not JSON") from None
        if resp.status >= 400:
            message = reply.get("error", resp.reason) if isinstance(reply, dict) else resp.reason
            raise ApiError(resp.status, str(message))
        if not isinstance(reply, dict):
            raise ConnectionError(f"{self.url}{path}: reply is not a JSON object")
        return reply

    def _connection(self) -> http.client.HTTPSConnection:
        if self._conn is None:
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout_s, context=self._ctx)
            try:
                conn.connect()
            except ssl.SSLError as exc:  # a wrong certificate, or not TLS at all
                conn.close()
                raise UntrustedDriver(
                    f"{self.url} is not the job's driver (TLS with the pinned certificate "
                    f"failed: {getattr(exc, 'verify_message', None) or exc.reason}); "
                    f"nothing was sent to it"
                ) from None
            if conn.sock.getpeercert(binary_form=True) != self._pin:
                conn.close()
                raise UntrustedDriver(f"{self.url} presented another certificate than the job's; nothing was sent")
            self._conn = conn
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def status(self) -> dict[str, Any]:
        return self.call("GET", "/v1/status")
