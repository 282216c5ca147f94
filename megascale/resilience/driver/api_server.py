"""The driver's HTTPS server: idle sockets are cheap, everything is bounded, bad requests get a 4xx.

Why not `http.server`: it spends a thread per connection and waits forever for bytes a client
promised (a Content-Length larger than the body, half a header), so ~1000 idle sockets stopped
it answering heartbeats and then ran it out of descriptors. Here one asyncio loop holds every
connection; httptools (llhttp, in C: h11 was a fifth of the driver's CPU at 1,536 nodes) parses
HTTP/1.1; the TLS handshake and each request must finish within their
deadlines; bodies and headers are capped; at the connection cap (set below the descriptor
limit, which is raised at start) the oldest idle connection is closed to make room, so a new
client is always served. Handlers run in a small thread pool (they take the driver's lock) and
get only bodies their route's schema accepted; every refusal is logged (rate-limited). A route
whose handler waits on nothing but the driver's lock (the heartbeat) runs on the loop thread
whenever that lock is free: at 1,536 nodes the pool's two thread hand-offs per request were a
tenth of the driver's CPU. When the lock is held it goes to the pool, so a long hold never
stops the loop.

Under load the clients that hold the token come first. Connections that have not yet shown the
token (in the handshake, or connected and silent) are capped apart (`max_unauthenticated`):
past it the oldest of them is closed, and they are closed before any authenticated one at the
connection cap, so a flood of idle sockets costs the flood, not the executors' kept-alive
connections. The handlers' queue is bounded too (`max_pending`; past it a 503 at once, which
executors retry) and a request is dropped unrun when its client has gone (its connection
closed) or it waited longer than the request timeout: the client gave up on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import json
import logging
import os
import resource
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import httptools
from pydantic import BaseModel, ValidationError

from megascale.resilience.common.protocol import first_error
from megascale.resilience.driver.api_budget import Budget, CallerBudgets, caller_key
from megascale.resilience.driver.identity import Principal

log = logging.getLogger("megascale.api")
Handler = Callable[[dict[str, Any], Principal], tuple[int, dict[str, Any]]]
RESERVED_FDS = 128  # the driver's own files: SQLite, logs, executors' pipes, evidence readers
HEAD_SLICE = 4096  # bytes of an incomplete request head fed to the parser at a time


@dataclass(frozen=True)
class Limits:
    max_body: int = 2 << 20
    max_header: int = 16 << 10
    handshake_timeout_s: float = 5.0
    request_timeout_s: float = 10.0  # a whole request from its first byte; also how long a connection may idle
    max_connections: int = 4096  # lowered to what the descriptor limit allows
    max_unauthenticated: int = 512  # connected, not yet past a request with the token
    max_pending: int = 1024  # requests queued for the handlers
    handler_threads: int = 4
    budget: Budget = Budget()  # per caller (api_budget.py)


class _Lock(Protocol):
    def acquire(self, blocking: bool = ...) -> bool: ...
    def release(self) -> None: ...


@dataclass(frozen=True)
class Route:
    handler: Handler
    schema: type[BaseModel] | None = None  # None: the request has no body
    callers: frozenset[str] = frozenset()  # the principals' roles that may call it (identity.py)
    # a handler that waits on nothing but this (reentrant) lock: while it is free the request is
    # answered on the loop thread, without the pool's two thread hand-offs (the heartbeat)
    inline_lock: _Lock | None = None


def raise_fd_limit() -> int:
    """Lift the soft descriptor limit to the hard one (often 1024 -> 1M); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(wanted: int) -> int:
    soft = raise_fd_limit()
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    return max(8, min(wanted, soft - in_use - RESERVED_FDS))


class ApiServer:
    """Serves `routes` ((method, path) -> Route) over TLS to callers `authenticate` knows."""

    def __init__(
        self,
        host: str,
        port: int,
        authenticate: Callable[[bytes], Principal | None],
        routes: dict[tuple[str, str], Route],
        ssl_context: ssl.SSLContext,
        limits: Limits | None = None,
    ) -> None:
        limits = limits or Limits()
        self.authenticate, self.routes, self.ctx, self.limits = authenticate, routes, ssl_context, limits
        self.paths = {path for _, path in routes}
        self.cap = connection_cap(limits.max_connections)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=1024)
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        self.conns: dict[_Connection, None] = {}  # oldest first: the first idle one is evicted
        self.unauthenticated: dict[_Connection, None] = {}  # oldest first, a subset of conns
        self.pending = 0  # requests submitted to the pool and not yet answered
        self.shed = 0  # requests refused or dropped for load (503)
        self.budgets = CallerBudgets(limits.budget)
        self.refusals = _RateLimitedLog(per_s=10)  # per status
        self.at_cap = _RateLimitedLog(per_s=2)  # per event at the caps
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(limits.handler_threads, thread_name_prefix="api-handler")
        self._thread = threading.Thread(target=self._run, name="driver-api", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    def start(self) -> ApiServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.add_reader(self._sock.fileno(), self._accept)
        try:
            self._loop.run_forever()
        finally:
            self._loop.remove_reader(self._sock.fileno())
            for conn in list(self.conns):
                conn.abort()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._sock.close()
            self._loop.close()

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        evictions = 0  # each one's descriptor is freed on a later turn of the loop: bounded per batch
        for _ in range(128):  # a batch per wake-up; the rest wait in the backlog
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors after all: shed one, pause, never spin
                self.at_cap.note("accept failures", "api: accept failed (%s); closing the oldest idle connection", exc)
                self.evict_idle()
                fd = self._sock.fileno()
                self._loop.remove_reader(fd)
                self._loop.call_later(0.1, self._loop.add_reader, fd, self._accept)
                return
            sock.setblocking(False)
            ip = peer[0] if isinstance(peer, tuple) else str(peer)
            evicted = len(self.conns) >= self.cap
            if evicted and not self.evict_idle():
                self.at_cap.note("busy refusals", "api: %s refused: %d connections, all busy", _peer(peer), self.cap)
                sock.close()
                continue
            if len(self.unauthenticated) >= self.limits.max_unauthenticated:
                oldest = self._most_unauthenticated()
                self.at_cap.note(
                    "tokenless closes",
                    "api: %d connections without a token yet: closed the oldest, from %s "
                    "(the address holding the most)",
                    len(self.unauthenticated),
                    oldest.peer,
                )
                oldest.abort()
                evicted = True
            conn = _Connection(self, sock, _peer(peer), ip)
            self.conns[conn] = None
            self.unauthenticated[conn] = None
            self._loop.create_task(conn.handshake())
            evictions += evicted
            if evictions >= RESERVED_FDS // 4:  # a batch at the cap once held 128 more and hit EMFILE
                return

    def _most_unauthenticated(self) -> _Connection:
        """The oldest connection without a token of the address that holds the most of them: a
        flood from one address sheds its own connections, never another's."""
        counts = Counter(c.ip for c in self.unauthenticated)
        top = max(counts.values())
        return next(c for c in self.unauthenticated if counts[c.ip] == top)

    def evict_idle(self) -> bool:
        """Make room at the cap: the oldest connection without a token, else the oldest idle one."""
        victim = next(iter(self.unauthenticated), None) or next((c for c in self.conns if not c.busy), None)
        if victim is not None:
            self.at_cap.note(
                "idle closes",
                "api: at the cap of %d connections: closed the oldest idle one, from %s",
                self.cap,
                victim.peer,
            )
            victim.abort()
        return victim is not None

    # ------------------------------------------------------------------ requests
    def check(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]], ip: str = ""
    ) -> tuple[int, str] | Principal:
        """The refusal (status, reason) of a request head, before its body is read; else who calls.
        A request within its caller's budget only (`api_budget.py`; `ip` names callers without
        a node credential)."""
        if sum(len(k) + len(v) for k, v in headers) > self.limits.max_header:  # _feed caps it only roughly
            return 431, f"headers exceed {self.limits.max_header} bytes"
        auth = [v for k, v in headers if k == b"authorization"]
        scheme, _, credential = (auth[0] if len(auth) == 1 else b"").partition(b" ")
        who = self.authenticate(credential.strip()) if scheme.lower() == b"bearer" else None
        if who is None:
            return 401, "missing or wrong token (Authorization: Bearer TOKEN)"
        if (method, path) not in self.routes:
            return (405, f"{path} does not take {method}") if path in self.paths else (404, f"no route {path}")
        if who.role not in self.routes[(method, path)].callers:
            return 403, f"{method} {path} is not for a{'n' if who.role[0] in 'aeio' else ''} {who.role} credential"
        length = next((v for k, v in headers if k == b"content-length"), b"0")
        if not length.isdigit():  # llhttp has refused most, not an empty one
            return 400, f"Content-Length {length[:20]!r} is not a number"
        if int(length) > self.limits.max_body:
            return 413, f"body of {int(length)} bytes exceeds {self.limits.max_body}"
        wait = self.budgets.take(caller_key(who, ip), self.budgets.cost(int(length)), time.monotonic())
        if wait:
            return 429, f"over this caller's request budget; retry in {max(wait, 0.1):.1f} s"
        return dataclasses.replace(who, address=ip)

    def call(
        self, method: str, path: str, body: bytes, who: Principal, queued: float = 0.0
    ) -> tuple[int, dict[str, Any]]:
        """Validate and handle one request (in a pool thread); never raises."""
        if queued and time.monotonic() - queued > self.limits.request_timeout_s:
            self.shed += 1  # its client has given up on it: an answer now would only cost the others
            return 503, {"error": f"waited over {self.limits.request_timeout_s:g} s for the driver; retry"}
        route = self.routes[(method, path)]
        try:
            if route.schema is None:
                if body.strip():
                    return 400, {"error": f"{method} {path} takes no body"}
                payload: dict[str, Any] = {}
            else:
                payload = route.schema.model_validate_json(body or b"{}").model_dump()
        except ValidationError as exc:
            return 400, {"error": f"bad request: {first_error(exc)}"}
        try:
            return route.handler(payload, who)
        except Exception:
            log.exception("api: %s %s failed", method, path)
            return 500, {"error": "internal error; the driver's log has the details"}

    def submit(self, method: str, path: str, body: bytes, who: Principal, key: str) -> Future | int:
        """Queue a request for the handlers; else the refusal's status: 503 when `max_pending`
        are queued already, 429 when its caller (`key`) has its share queued."""
        if self.pending >= self.limits.max_pending:
            self.shed += 1
            return 503
        if not self.budgets.queue(key):
            return 429
        self.pending += 1
        return self._pool.submit(self.call, method, path, body, who, time.monotonic())

    def on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the loop thread (from a pool thread: one wake-up of the loop)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is answered any more
            self._loop.call_soon_threadsafe(fn, *args)

    def answered(self, key: str) -> None:
        """A submitted request of caller `key` is done (on the loop thread)."""
        self.pending -= 1
        self.budgets.done(key)


class _Refusal(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status, self.why = status, why


@dataclass
class _Request:
    method: str
    path: str
    who: Principal
    body: bytearray = dataclasses.field(default_factory=bytearray)
    keep_alive: bool = True


class _Connection(asyncio.Protocol):
    """One client connection: TLS handshake, then requests answered one at a time, in order, each
    within its deadline. httptools (llhttp, in C) parses; the callbacks named `on_*` are its. A
    head is checked (token, route, length, budget) as soon as it is complete, before its body is
    read; complete requests wait in `queue` while one is answered, and a refusal ends the queue."""

    def __init__(self, server: ApiServer, sock: socket.socket, peer: str, ip: str) -> None:
        self.server, self.sock, self.peer, self.ip = server, sock, peer, ip
        self.loop = server._loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.busy = self.closed = self.write_paused = self.refusing = False
        self.keep_alive = True  # of the request being answered
        self.idle = True  # between requests: the next byte starts a request's own deadline
        self.request_started = 0.0  # loop time of the current request's first byte
        self.began = False  # the parser is inside a request (its first byte came)
        self.head_bytes = 0  # bytes fed since the current head began, while it is incomplete
        self.request: tuple[str, str] | None = None  # method and path of the request being read or answered
        self.url = bytearray()
        self.headers: list[tuple[bytes, bytes]] = []
        self.current: _Request | None = None  # the request being parsed, once its head passed (None: in a head)
        self.queue: deque[_Request | _Refusal] = deque()  # parsed, not yet answered
        self.timer: asyncio.TimerHandle | None = None
        self.future: Future | None = None

    async def handshake(self) -> None:
        try:
            await self.loop.connect_accepted_socket(
                lambda: self,
                self.sock,
                ssl=self.server.ctx,
                ssl_handshake_timeout=self.server.limits.handshake_timeout_s,
            )
        except Exception as exc:  # a client that is not one: bad TLS, silence, a reset
            log.debug("api: handshake with %s failed: %s", self.peer, exc)
            self.closed = True
            self._forget()
            with contextlib.suppress(OSError):
                self.sock.close()

    def abort(self) -> None:
        self._forget()
        if self.transport is not None:
            self.transport.abort()
        else:  # still in the handshake: end it from below
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def _forget(self) -> None:
        self.server.conns.pop(self, None)
        self.server.unauthenticated.pop(self, None)
        if self.future is not None:
            self.future.cancel()  # not run if it has not started: its client is gone

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._arm(self.server.limits.request_timeout_s)

    def pause_writing(self) -> None:
        self.write_paused = True  # a client that sends requests and never reads the answers

    def resume_writing(self) -> None:
        self.write_paused = False
        if not (self.busy or self.closed):
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self._forget()

    def data_received(self, data: bytes) -> None:
        if self.closed or self.refusing:  # after a refusal the rest of what the client sends is dropped
            return
        if self.idle and data:  # a request's time starts with its first byte, not the last answer
            self.idle, self.request_started = False, self.loop.time()
        try:
            self._feed(data)
        except _Refusal as refusal:
            self._stop_parsing(refusal)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__  # what a callback raised
            if not isinstance(cause, _Refusal):
                log.error("api: a request from %s failed in its checks", self.peer, exc_info=cause)
                cause = _Refusal(500, "internal error; the driver's log has the details")
            self._stop_parsing(cause)
        except httptools.HttpParserUpgrade:
            self._stop_parsing(_Refusal(400, "protocol upgrades are not served"))
        except httptools.HttpParserError as exc:
            self._stop_parsing(_Refusal(400, f"malformed HTTP: {exc}"))
        self._next()

    def eof_received(self) -> bool:
        if not (self.closed or self.busy or self.queue):
            self._close()
        return False

    # ------------------------------------------------------------------ parsing
    def _feed(self, data: bytes) -> None:
        """A head is fed a slice at a time and its bytes counted (httptools gathers a header
        before calling back): a client streaming one endless header is refused at the cap."""
        cap = self.server.limits.max_header
        while data:
            if self.current is not None:  # past the head: the body, and what follows it
                self.parser.feed_data(data)
                return
            if self.head_bytes > cap:
                raise _Refusal(431, f"request head exceeds {cap} bytes")
            piece, data = data[:HEAD_SLICE], data[HEAD_SLICE:]
            self.head_bytes += len(piece)
            self.parser.feed_data(piece)

    def _stop_parsing(self, refusal: _Refusal) -> None:
        self.refusing = True
        self.queue.append(refusal)  # answered after the requests parsed before it

    def on_message_begin(self) -> None:
        self.began = True
        self.url.clear()
        self.headers = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        method = self.parser.get_method().decode(errors="replace")
        path = self.url.decode(errors="replace").split("?")[0]
        self.request = (method, path)
        checked = self.server.check(method, path, self.headers, self.ip)
        if isinstance(checked, Principal) or checked[0] != 401:
            self.server.unauthenticated.pop(self, None)  # it holds a credential
        if not isinstance(checked, Principal):
            raise _Refusal(*checked)
        self.current = _Request(method, path, checked)

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.body += body
        if len(self.current.body) > self.server.limits.max_body:
            raise _Refusal(413, f"body exceeds {self.server.limits.max_body} bytes")

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.current.keep_alive = self.parser.should_keep_alive()
        self.queue.append(self.current)
        self.current, self.began, self.head_bytes = None, False, 0

    # ------------------------------------------------------------------ answering
    def _next(self) -> None:
        """Answer the next parsed request, or read on when none is left. Not while the client
        leaves its answers unread (`resume_writing` calls again)."""
        if self.busy or self.closed or self.write_paused:
            return
        if not self.queue:
            self.transport.resume_reading()
            return
        item = self.queue.popleft()
        if isinstance(item, _Refusal):
            return self._refuse(item.status, item.why)
        self._dispatch(item)

    def _dispatch(self, request: _Request) -> None:
        self.busy, self.request = True, (request.method, request.path)
        self.keep_alive = request.keep_alive
        if self.timer is not None:
            self.timer.cancel()
        self.transport.pause_reading()
        call = (request.method, request.path, bytes(request.body), request.who)
        lock = self.server.routes[(request.method, request.path)].inline_lock
        if lock is not None and lock.acquire(blocking=False):
            try:
                status, data = self.server.call(*call)
            finally:
                lock.release()
            # answered from the loop's next round, not from here: a client's pipelined requests
            # must not recurse (_answer -> _next -> _dispatch) one stack frame each
            self.loop.call_soon(self._answer, status, data)
            return
        key = caller_key(request.who, self.ip)
        future = self.server.submit(*call, key)
        if future == 503:
            return self._refuse(503, f"{self.server.limits.max_pending} requests queued already; retry")
        if future == 429:
            return self._refuse(
                429, f"this caller has {self.server.limits.budget.max_pending} requests queued already; retry"
            )
        assert isinstance(future, Future)
        self.future = future
        future.add_done_callback(lambda f: self.server.on_loop(self._reply, f, key))

    def _reply(self, future: Future, key: str) -> None:
        self.server.answered(key)
        self.future = None
        status, data = future.result() if not future.cancelled() else (503, {"error": "shutting down"})
        self._answer(status, data)

    def _answer(self, status: int, data: dict[str, Any]) -> None:
        if self.closed:
            return
        if status >= 400:
            self._log_refusal(status, data.get("error", ""))
            return self._respond(status, data, close=True)
        if not self.keep_alive:  # the client asked to close after this answer
            return self._respond(status, data, close=True)
        self._respond(status, data, close=False)
        self.busy, self.request = False, None
        self.idle = not (self.began or self.queue)  # pipelined bytes already began the next request
        self.request_started = self.loop.time()
        self._arm(self.server.limits.request_timeout_s)
        self._next()  # a request the client already sent behind this one

    def _refuse(self, status: int, why: str) -> None:
        self._log_refusal(status, why)
        self._respond(status, {"error": why}, close=True)

    def _log_refusal(self, status: int, why: str) -> None:
        method, path = self.request or ("-", "-")
        self.server.refusals.note(
            f"{status} refusals", "api: %d %s %s from %s: %s", status, method, path, self.peer, why
        )

    def _respond(self, status: int, data: dict[str, Any], close: bool) -> None:
        raw = json.dumps(data, default=str).encode()
        head = f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        head += f"content-length: {len(raw)}\r\n"
        if status == 401:
            head += 'www-authenticate: Bearer realm="megascale"\r\n'
        if status in (429, 503):
            head += "retry-after: 1\r\n"
        if close:
            head += "connection: close\r\n"
        self.transport.write(head.encode() + b"\r\n" + raw)
        if close:
            self._close()

    def _close(self) -> None:
        self.closed = True
        self._forget()
        self.transport.close()  # after what is written; a client that never reads is aborted:
        self._arm(2.0)

    def _arm(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        if self.closed:
            return self.transport.abort()
        if self.busy:
            return
        if self.idle or not (self.began or self.queue):
            return self.abort()  # idle keep-alive: close quietly
        left = self.request_started + self.server.limits.request_timeout_s - self.loop.time()
        if left > 0:  # the timer ran from the last answer; this request began later
            return self._arm(left)
        self._refuse(408, f"request not complete within {self.server.limits.request_timeout_s:g} s")


class _RateLimitedLog:
    """At most `per_s` lines a second of each kind (a status, a cap's event; few): a flood must not
    flood the log, nor hide another kind (401s of wrong tokens once hid a node's forged 403s)."""

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self.windows: dict[str, list[float]] = {}  # kind -> [window start, logged, dropped]

    def note(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        window = self.windows.setdefault(kind, [now, 0, 0])
        if now - window[0] >= 1.0:
            if window[2]:
                log.warning("api: %d more %s in the last second, not logged one by one", window[2], kind)
            window[:] = [now, 0, 0]
        if window[1] < self.per_s:
            window[1] += 1
            log.warning(message, *args)
        else:
            window[2] += 1


def _peer(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
