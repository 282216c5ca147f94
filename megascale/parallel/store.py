"""Rendezvous stores for start-up: TCPStore or Redis, wrapped in an operation counter.

Start-up cost is store traffic: every group creation exchanges addresses (gloo) or unique ids
(NCCL) through the store, and every global barrier is `world` adds and waits on one key. The
`CountingStore` wrapper sees each operation a rank makes (its own and those the backends make in
C++ through the `torch.distributed.Store` trampoline), so the per-rank cost of a creation scheme
is measured rather than argued.

What listens where: the rank-0 TCPStore serves MASTER_PORT. PyTorch binds it to every interface
whatever host it is given, so when MASTER_ADDR is an address of this machine (127.0.0.1 in local
runs, the node's own address on a cluster) rank 0 hands it a socket bound to that address only
(`bound_listener`); the store has no authentication, so firewall the port between nodes
(docs/cluster.md, docs/security.md). And it stops taking connections once every rank of the
world holds one (`seal_when_joined`): the ranks keep using theirs (gloo's and NCCL's later group
creations go through them), while anyone else who connects to MASTER_PORT later gets nothing.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megascale.config.fields import ConfigError
from megascale.config.schema import ParallelConfig

# Key that PyTorch's store-based barrier (init/new_group barrier) adds to; one add per barrier.
_BARRIER_KEY = "store_based_barrier_key"
JOINED_KEY = "ranks_connected"  # each rank adds 1 once its store client is connected
SO_ATTACH_FILTER = 26  # linux/socket.h
log = logging.getLogger(__name__)


class CountingStore(dist.Store):
    """Forward every call to `inner` and count it by kind; barriers counted apart."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self._lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.barriers = 0

    def _count(self, kind: str) -> None:
        with self._lock:
            self.ops[kind] += 1

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()
            self.barriers = 0

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    def set(self, key: str, value: bytes | str) -> None:
        self._count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        if amount == 1 and _BARRIER_KEY in key:
            with self._lock:
                self.barriers += 1
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait")
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys")
        return self.inner.num_keys()

    def append(self, key: str, value: bytes | str) -> None:
        self._count("append")
        self.inner.append(key, value)

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.inner.set_timeout(timeout)


@dataclass
class StartupStats:
    """What one rank paid to start: wall time, store operations by kind, global barriers.

    `init_ops` is the default group's rendezvous, `group_ops` the creation of the mesh's groups.
    """

    store: str = "none"
    time_s: float = 0.0
    store_ops: dict[str, int] = field(default_factory=dict)
    init_ops: int = 0
    group_ops: int = 0
    barriers: int = 0
    groups_created: int = 0

    @property
    def total_store_ops(self) -> int:
        return sum(self.store_ops.values())

    def summary(self) -> str:
        return (
            f"start-up {self.time_s:.3f}s store={self.store} ops={self.total_store_ops} "
            f"(init {self.init_ops}, groups {self.group_ops}) "
            f"{dict(sorted(self.store_ops.items()))} barriers={self.barriers} "
            f"groups={self.groups_created}"
        )


@dataclass(frozen=True)
class StoreAddress:
    """Where this job's rendezvous lives, plus the key namespace of this attempt."""

    host: str
    port: int
    job_id: str
    attempt: int

    @classmethod
    def from_env(cls, env: os._Environ[str] | dict[str, str] | None = None, need_master: bool = True) -> StoreAddress:
        """Read the torchrun variables; MASTER_ADDR/PORT are only needed for the TCPStore."""
        env = os.environ if env is None else env
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing and need_master:
            raise ConfigError(
                f"distributed start-up needs {' and '.join(missing)} in the environment "
                "(torchrun sets them; or export MASTER_ADDR=127.0.0.1 MASTER_PORT=<free port>)"
            )
        job = env.get("MEGASCALE_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "job"
        attempt = env.get("MEGASCALE_RESTART_ATTEMPT") or env.get("TORCHELASTIC_RESTART_COUNT")
        host, port = env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT") or 0)
        return cls(host, port, job, int(attempt or 0))

    @property
    def prefix(self) -> str:
        return attempt_prefix(self.job_id, self.attempt)


def attempt_prefix(job_id: str, attempt: int) -> str:
    """The key namespace of one attempt of one job, on either store."""
    return f"megascale/{job_id}/attempt{attempt}/"


def create_store(cfg: ParallelConfig, rank: int, world_size: int, address: StoreAddress) -> dist.Store:
    """The rendezvous store `cfg.store` names, keys namespaced by job and restart attempt."""
    timeout = timedelta(seconds=cfg.init_timeout_s)
    if cfg.store == "redis":
        from megascale.parallel.redis_store import RedisStore

        inner: dist.Store = RedisStore(
            cfg.redis_url,
            prefix=address.prefix,
            timeout=timeout,
            connect_timeout_s=cfg.redis_connect_timeout_s,
            password=cfg.redis_password(),
        )
        return inner
    # Under torchrun the agent already hosts the TCPStore on MASTER_PORT; workers join it.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        tcp = dist.TCPStore(
            address.host, address.port, world_size, is_master=False, timeout=timeout, wait_for_workers=False
        )
    else:
        tcp = sealed_tcp_store(address, world_size, rank == 0, timeout)
    return dist.PrefixStore(address.prefix, tcp)


def sealed_tcp_store(address: StoreAddress, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore of `world_size` members that takes no new connection once they all hold one:
    the master binds `address.host` only (`bound_listener`) and seals the listener when every
    member has counted itself in (`seal_when_joined`). The rendezvous of an attempt and the
    self-check's pair groups (`resilience/selfcheck/checks.py`) are both made this way."""
    listen = bound_listener(address.host, address.port) if is_master else {}
    listener = socket.socket(fileno=os.dup(listen["master_listen_fd"])) if listen else None
    tcp = dist.TCPStore(
        address.host,
        address.port,
        world_size,
        is_master=is_master,
        timeout=timeout,
        wait_for_workers=False,
        **listen,
    )
    tcp.add(address.prefix + JOINED_KEY, 1)
    if listener is not None:
        threading.Thread(
            target=seal_when_joined,
            args=(listener, address, world_size, timeout.total_seconds()),
            name="store-seal",
            daemon=True,
        ).start()
    return tcp


def seal_when_joined(listener: socket.socket, address: StoreAddress, world_size: int, timeout_s: float) -> None:
    """Once `world_size` ranks have connected (or the rendezvous timed out), stop the store's
    listener taking connections. Polled on a client of its own: the ranks' clients may be
    blocked in a `wait`. The listener is not closed (PyTorch's libuv loop would spin on a dead
    one) but given a socket filter that drops every packet, so a new connection never forms."""
    key, deadline = address.prefix + JOINED_KEY, time.monotonic() + timeout_s
    try:
        probe = dist.TCPStore(
            address.host,
            address.port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        while probe.add(key, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        del probe
        seal(listener)
        log.info("rendezvous store %s:%d sealed: no new connections", address.host, address.port)
    except (OSError, RuntimeError) as exc:  # the store went first (a rank failed): nothing to seal
        log.warning("rendezvous store %s:%d not sealed: %s", address.host, address.port, exc)
    finally:
        listener.close()


class _BpfInsn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _BpfProg(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_BpfInsn))]


def seal(listener: socket.socket) -> None:
    """Drop every packet that reaches `listener` (classic BPF `ret #0`): no handshake completes;
    connections it already accepted are sockets of their own, untouched."""
    program = (_BpfInsn * 1)(_BpfInsn(0x06, 0, 0, 0))  # BPF_RET | BPF_K, accept 0 bytes
    listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(_BpfProg(1, program)))


def bound_listener(host: str, port: int) -> dict[str, int]:
    """TCPStore arguments that make its server listen on `host` only, when `host` is an IP address
    this machine has; otherwise none (PyTorch then listens on every interface)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return {}  # a name: torch resolves it for the workers but binds the server everywhere
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:  # not an address of ours, or the port is taken: torch says so in its own words
        sock.close()
        return {}
    return {"master_listen_fd": sock.detach()}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at `host` right now ("" = on every interface), for a server
    that starts a moment later.

    Chosen at random below the kernel's ephemeral range, not by binding port 0: a port-0 pick
    comes from that range, where every outgoing connection and every other port-0 listener on
    the machine draw theirs too, and one of them can take it in the gap before the server binds
    it (CI saw a TCPStore fail with EADDRINUSE that way, among many tests started in parallel).
    """
    candidates = range(_FIRST_PORT, _ephemeral_range()[0])  # a range: sampled without a list of 20k ports
    for port in _RANDOM.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all taken: any port will do
        s.bind((host, 0))
        return s.getsockname()[1]


_FIRST_PORT = 10_000  # below are the well-known and commonly configured services' ports
_RANDOM = random.SystemRandom()  # not the training RNG: a seeded job must not pick its ports


def _ephemeral_range() -> tuple[int, int]:
    """Linux's range for port-0 binds and outgoing connections (its default where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999
