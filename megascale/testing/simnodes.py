"""Simulated executors: hundreds of nodes in one asyncio process, speaking the driver's protocol.

What scale does to the driver is measured against the real thing: a real `megascale launch
--external` process, and nodes that do what executors do on the wire — one kept-alive TLS
connection each that trusts only the job's pinned certificate, a bearer token, HTTP/1.1 with
JSON bodies the driver's schemas check — without ranks behind them. Each node registers, then
heartbeats at the period the driver asks for, with the payload of a real node of
`ranks_per_node` ranks (process status, step, step time and the step and compute times no
answered heartbeat carried yet, per rank; hardware, interface counters), answers `start`,
`pause`, `stop` and `selfcheck` as a healthy node's executor would (at once: nothing runs
behind them), and can be told to fall silent. Each round trip is timed; the driver's own CPU
is read from /proc by the caller.

Steps are simulated from the clock: every rank of the job is at step `(now - start) / step_s`
of its attempt, so the hang and slowdown rules see a healthy job.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megascale.resilience.common.credentials import pinned_context
from megascale.resilience.common.rankstatus import DeliveredSteps

RECENT = 8  # step times a simulated rank remembers (a real status file keeps 16); a heartbeat
# sends those no answered heartbeat carried, as the executor does


@dataclass
class NodeStats:
    registered_s: float | None = None  # from the fleet's start to the registration's reply
    rtts: list[float] = field(default_factory=list)  # heartbeat round trips, seconds
    commands: list[tuple[float, str]] = field(default_factory=list)  # (when received, kind)
    errors: list[str] = field(default_factory=list)


class SimNode:
    def __init__(self, fleet: Fleet, index: int) -> None:
        self.fleet, self.index = fleet, index
        self.node_id = f"sim{index:05d}"
        self.stats = NodeStats()
        self.attempt: int | None = None
        self.ranks: list[int] = []
        self.started = 0.0
        self.last_ok = 0.0  # monotonic time of the last heartbeat the driver answered
        self.credential = ""  # this node's own, from its registration's reply (identity.py)
        self.done: dict[str, Any] = {}
        self.delivered = DeliveredSteps()
        self.silent = asyncio.Event()
        self.heartbeat_s = 1.0
        self.seq = 0
        self._io: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._net = [random.randrange(1 << 30), random.randrange(1 << 30)]

    async def call(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One request on the node's kept-alive connection (re-opened once if the driver closed it)."""
        raw = json.dumps(body).encode()
        credential = self.credential or self.fleet.token_for(self.node_id)  # the join token until registered
        head = (
            f"POST {path} HTTP/1.1\r\nHost: driver\r\nAuthorization: Bearer {credential}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
        ).encode()
        for last_try in (False, True):
            try:
                if self._io is None:
                    self._io = await asyncio.wait_for(
                        asyncio.open_connection(self.fleet.host, self.fleet.port, ssl=self.fleet.ctx),
                        self.fleet.timeout_s,
                    )
                reader, writer = self._io
                writer.write(head + raw)
                return await asyncio.wait_for(self._response(reader), self.fleet.timeout_s)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ssl.SSLError, ValueError) as exc:
                self.close()
                if last_try:
                    raise ConnectionError(f"{path}: {exc!r}") from exc
        raise AssertionError("unreachable")

    async def _response(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, json.loads(body or b"{}")

    def close(self) -> None:
        if self._io is not None:
            self._io[1].close()
            self._io = None

    async def register(self) -> None:
        body = {
            "node_id": self.node_id,
            "address": f"10.{self.index >> 16 & 255}.{self.index >> 8 & 255}.{self.index & 255}",
            "host": self.node_id,
            "pid": os.getpid(),
        }
        while True:
            try:
                status, reply = await self.call("/v1/register", body)
            except ConnectionError as exc:
                self.stats.errors.append(str(exc))
                await asyncio.sleep(0.5 + random.random())
                continue
            if status in (429, 503):  # the driver sheds load: as an executor does, try again
                await asyncio.sleep(0.5 + random.random())
                continue
            if status != 200:
                raise RuntimeError(f"{self.node_id}: registration refused: {status} {reply}")
            self.heartbeat_s = reply["heartbeat_s"]
            self.credential = reply.get("credential", "")
            self.stats.registered_s = time.monotonic() - self.fleet.began
            return

    def report(self) -> dict[str, Any]:
        """A heartbeat of the real shape: what `Executor.report` sends for a node of R ranks."""
        self.seq += 1
        now = time.time()
        ranks = []
        if self.attempt is not None:
            self.delivered.begin(self.attempt)
            step = max(0, int((now - self.started) / self.fleet.step_s))
            recent = [
                [s, self.fleet.step_s * (1 + 0.02 * random.random())]
                for s in range(max(1, step - RECENT + 1), step + 1)
            ]
            ranks = [
                {
                    "rank": r,
                    "local_rank": i,
                    "pid": 100000 + r,
                    "alive": True,
                    "exitcode": None,
                    "exited_at": None,
                    "state": "running",
                    "step": step or None,
                    "step_time": self.fleet.step_s if step else None,
                    # only the pairs no answered heartbeat carried, as `Executor` sends them
                    "recent": self.delivered.new(r, "recent", recent) if step else [],
                    "compute": self.delivered.new(r, "compute", [[s, 0.8 * t] for s, t in recent]) if step else [],
                    "status_time": now,
                    "start": None,
                    "phase": "training",
                }
                for i, r in enumerate(self.ranks)
            ]
        self._net[0] += random.randrange(1 << 20, 1 << 22)
        self._net[1] += random.randrange(1 << 20, 1 << 22)
        return {
            "node_id": self.node_id,
            "seq": self.seq,
            "time": now,
            "address": f"10.0.0.{self.index & 255}",
            "host": self.node_id,
            "hardware": {"cpus": 192, "cpu_percent": 40.0, "mem_total": 2 << 40, "mem_used": 1 << 40, "gpus": []},
            "attempt": self.attempt,
            "ranks": ranks,
            "errors": [],
            "net": {"eth0": list(self._net)},
            "net_shared": False,
            "done": dict(self.done),
            "busy": None,
        }

    async def run(self) -> None:
        await self.register()
        await asyncio.sleep(random.random() * self.heartbeat_s)  # executors do not beat in lock step
        while not self.fleet.stopping.is_set():
            if self.silent.is_set():
                self.close()
                await self.fleet.stopping.wait()
                return
            started = time.monotonic()
            try:
                status, reply = await self.call("/v1/heartbeat", self.report())
            except ConnectionError as exc:
                self.stats.errors.append(str(exc))
                await asyncio.sleep(self.heartbeat_s)
                continue
            self.stats.rtts.append(time.monotonic() - started)
            self.last_ok = time.monotonic()
            if status != 200:
                self.stats.errors.append(f"heartbeat: {status} {reply.get('error')}")
                if status == 403:
                    return
            else:
                self.delivered.answered()
                self._handle(reply)
            await asyncio.sleep(max(0.0, self.heartbeat_s - (time.monotonic() - started)))
        self.close()

    def _handle(self, reply: dict[str, Any]) -> None:
        for command_id in reply.get("ack", []):
            self.done.pop(command_id, None)
        self.heartbeat_s = reply.get("heartbeat_s") or self.heartbeat_s
        for command in reply.get("commands", []):
            self.stats.commands.append((time.monotonic(), command["kind"]))
            if command["kind"] == "start":
                self.attempt, self.ranks, self.started = command["attempt"], command["ranks"], time.time()
                self.done[command["id"]] = {"ok": True, "pids": [100000 + r for r in self.ranks]}
            elif command["kind"] == "pause":
                self.attempt = None  # paused: its ranks report nothing more
                self.done[command["id"]] = {"ok": True, "paused": self.ranks, "dead": []}
            elif command["kind"] == "stop":
                self.attempt = None
                self.done[command["id"]] = {"ok": True, "stopped": len(self.ranks)}
            elif command["kind"] == "selfcheck":  # a healthy node: every test passes
                tests = [
                    {"name": "memory_bandwidth", "value": 10.0, "unit": "GB/s", "expected": 1.0, "passed": True},
                    *(
                        {
                            "name": "all_reduce",
                            "peer": p["peer"],
                            "passed": True,
                            "value": 1.0,
                            "unit": "GB/s",
                            "expected": 0.1,
                        }
                        for p in command["plan"]["pairs"]
                    ),
                ]
                self.done[command["id"]] = {
                    "ok": True,
                    "report": {
                        "node": self.node_id,
                        "host": self.node_id,
                        "pid": os.getpid(),
                        "passed": True,
                        "tests": tests,
                    },
                }
            elif command["kind"] == "exit":
                self.fleet.exited += 1


class Fleet:
    """`count` simulated nodes against the driver at `url`; run them with `asyncio.run(fleet.run(...))`."""

    def __init__(
        self,
        url: str,
        token: str,
        cert_pem: bytes,
        count: int,
        ranks_per_node: int = 8,
        step_s: float = 1.0,
        timeout_s: float = 30.0,
        token_for: Callable[[str], str] | None = None,
    ) -> None:
        host_port = url.removeprefix("https://")
        self.host, _, port = host_port.rpartition(":")
        self.port, self.ctx, self.step_s, self.timeout_s = int(port), pinned_context(cert_pem), step_s, timeout_s
        self.token_for = token_for or (lambda node: token)
        self.nodes = [SimNode(self, i) for i in range(count)]
        self.ranks_per_node = ranks_per_node
        self.began = time.monotonic()
        self.stopping = asyncio.Event()
        self.exited = 0
        self.lag_max = 0.0  # the longest this process's event loop was late (a starved harness)

    async def run(self, script: Callable[[Fleet], Any]) -> Any:
        """Start every node at once, run `script(fleet)` (a coroutine function) beside them, stop."""
        self.began = time.monotonic()
        tasks = [asyncio.create_task(node.run()) for node in self.nodes]
        tasks.append(asyncio.create_task(self._watch_lag()))
        try:
            return await script(self)
        finally:
            self.stopping.set()
            await asyncio.wait(tasks, timeout=10)
            for node in self.nodes:
                node.close()

    async def _watch_lag(self, every_s: float = 0.1) -> None:
        """A late wake-up here is a late heartbeat there: the harness, not the driver, was slow."""
        while not self.stopping.is_set():
            due = time.monotonic() + every_s
            await asyncio.sleep(every_s)
            self.lag_max = max(self.lag_max, time.monotonic() - due)

    async def registered(self, timeout_s: float) -> float:
        """Seconds until every node had its registration answered."""
        deadline = time.monotonic() + timeout_s
        while any(n.stats.registered_s is None for n in self.nodes):
            if time.monotonic() > deadline:
                missing = sum(n.stats.registered_s is None for n in self.nodes)
                raise TimeoutError(f"{missing} of {len(self.nodes)} nodes not registered within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        return max(n.stats.registered_s or 0.0 for n in self.nodes)

    def heartbeats(self) -> int:
        return sum(len(n.stats.rtts) for n in self.nodes)

    def rtts_since(self, counts: list[int]) -> list[float]:
        return [t for n, c in zip(self.nodes, counts, strict=True) for t in n.stats.rtts[c:]]

    def marks(self) -> list[int]:
        return [len(n.stats.rtts) for n in self.nodes]
