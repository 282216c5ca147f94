"""A `torch.distributed.Store` on Redis, for rendezvous and process-group creation.

MegaScale replaced PyTorch's TCPStore, which then served every request from one thread, with
Redis and cut Megatron's start-up on 2,048 GPUs from 1,047 s to 361 s. This store keeps
TCPStore's semantics (blocking `get`/`wait` with the store's timeout, `add` returning the new
count, `compare_set` as in c10d) so gloo and NCCL use it unchanged:

- every key lives under a prefix `megascale/<job>/attempt<k>/`, so a restarted job never reads
  the addresses or barrier counters its previous attempt left behind;
- writers publish the key name on a channel after writing, so a waiter subscribes, re-checks,
  and sleeps until told, instead of polling Redis;
- an unreachable server fails within `connect_timeout_s` with an error naming the address.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import redis
import torch.distributed as dist
from redis.backoff import NoBackoff
from redis.retry import Retry

from megascale.config.schema import redacted_url

# TCPStore semantics of compare_set, atomically: set only if the current value is `expected`
# (a missing key counts as ""); return the value now stored, or `expected` if the key is absent.
_COMPARE_SET = """
local cur = redis.call('GET', KEYS[1])
if (not cur and ARGV[1] == '') or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  redis.call('PUBLISH', KEYS[1], '1')
  return ARGV[2]
end
if not cur then return ARGV[1] end
return cur
"""


class StoreUnreachableError(ConnectionError):
    """The rendezvous store could not be reached; the message names its address."""


class RedisStore(dist.Store):
    def __init__(
        self,
        url: str,
        prefix: str = "",
        timeout: timedelta = timedelta(seconds=300),
        connect_timeout_s: float = 10.0,
        password: str | None = None,
    ) -> None:
        """`password` is used when the URL has none ($MEGASCALE_REDIS_PASSWORD, via the config)."""
        super().__init__()
        self.url, self._password = url, password
        self.prefix = prefix
        self.set_timeout(timeout)
        # A bare RESP2 connection: no HELLO round trip (redis-py 8 sends one for RESP3), which every
        # connection (each rank's, and each waiting thread's subscriber) would pay while the
        # whole job connects at once. Retries are ours, bounded by connect_timeout_s.
        bare = {"protocol": 2, "retry": Retry(NoBackoff(), 0), **({"password": password} if password else {})}
        connect_s = min(connect_timeout_s, 5.0)
        probe = redis.Redis.from_url(url, socket_connect_timeout=connect_s, socket_timeout=connect_s, **bare)
        kw = probe.connection_pool.connection_kwargs
        self.address = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
        self._ping(probe, connect_timeout_s)
        # Once the server answers, one command may queue behind a whole job's start-up traffic:
        # bound it by the store's timeout, as the TCPStore does, not by redis-py's default 5 s.
        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=connect_s, socket_timeout=timeout.total_seconds(), **bare
        )
        self._compare_set = self._client.register_script(_COMPARE_SET)
        self._local = threading.local()

    def _ping(self, probe: redis.Redis, connect_timeout_s: float) -> None:
        """Fail within `connect_timeout_s`, naming the address, if no server answers there."""
        deadline = time.monotonic() + connect_timeout_s
        try:
            while True:
                try:
                    probe.ping()
                    return
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    if time.monotonic() >= deadline:
                        raise StoreUnreachableError(
                            f"Redis store at {self.address} ({redacted_url(self.url)}) not reachable within "
                            f"{connect_timeout_s:.0f}s: {exc}. Start redis-server there or fix "
                            "parallel.redis_url"
                        ) from exc
                    time.sleep(0.2)
        finally:
            probe.close()

    def _k(self, key: str) -> str:
        return self.prefix + key

    # -- the Store interface -----------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._k(key), value)
        pipe.publish(self._k(key), b"1")
        pipe.execute()

    def get(self, key: str) -> bytes:
        value = self._client.get(self._k(key))
        while value is None:
            self._wait_for([key], self.timeout)
            value = self._client.get(self._k(key))
        return value

    def add(self, key: str, amount: int) -> int:
        pipe = self._client.pipeline(transaction=False)
        pipe.incrby(self._k(key), amount)
        pipe.publish(self._k(key), b"1")
        return int(pipe.execute()[0])

    def append(self, key: str, value: bytes | str) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.append(self._k(key), value)
        pipe.publish(self._k(key), b"1")
        pipe.execute()

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._compare_set(keys=[self._k(key)], args=[expected, desired])

    def check(self, keys: list[str]) -> bool:
        return self._client.exists(*[self._k(k) for k in keys]) == len(keys)

    def delete_key(self, key: str) -> bool:
        return bool(self._client.delete(self._k(key)))

    def num_keys(self) -> int:
        return sum(1 for _ in self._client.scan_iter(match=key_pattern(self.prefix), count=1000))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists, or raise after `timeout` (the store's by default)."""
        if not self.check(keys):
            self._wait_for(keys, timeout or self.timeout)

    def _wait_for(self, keys: list[str], timeout: timedelta) -> None:
        # One subscriber connection per thread, kept open: reconnecting for every wait would
        # cost more round trips than the wait itself.
        pubsub = getattr(self._local, "pubsub", None)
        if pubsub is None:
            pubsub = self._local.pubsub = self._client.pubsub()
        channels = [self._k(k) for k in keys]
        limit = timeout.total_seconds()
        deadline = time.monotonic() + limit
        self._subscribe(pubsub, channels, deadline)
        try:
            while not self.check(keys):  # checked after subscribing: no lost wake-up
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k for k in keys if not self._client.exists(self._k(k))]
                    raise dist.DistStoreError(
                        f"wait timed out after {limit:.0f}s on Redis store {self.address}: "
                        f"keys {missing} under prefix {self.prefix!r} never appeared"
                    )
                pubsub.get_message(timeout=left)  # any message: re-check; no polling
        finally:
            pubsub.unsubscribe(*channels)

    @staticmethod
    def _subscribe(pubsub: redis.client.PubSub, channels: list[str], deadline: float) -> None:
        """Subscribe and read the server's confirmations: the check that follows goes over
        another connection, and must not reach the server before the subscription does."""
        pubsub.subscribe(*channels)
        pending = {c.encode() for c in channels}
        while pending and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=max(deadline - time.monotonic(), 0.0))
            if message is not None and message["type"] == "subscribe":
                pending.discard(message["channel"])

    # -- housekeeping --------------------------------------------------------------------------
    def clear(self) -> int:
        """Delete every key of this store's prefix (a finished attempt); returns how many."""
        return delete_prefix(self.url, self.prefix, self._password)

    def close(self) -> None:
        pubsub = getattr(self._local, "pubsub", None)
        if pubsub is not None:
            pubsub.close()
        self._client.close()


def delete_prefix(url: str, prefix: str, password: str | None = None, timeout_s: float = 5.0) -> int:
    """Delete every key under `prefix` (a finished attempt's); returns how many."""
    pattern = key_pattern(prefix)
    auth = {"password": password} if password else {}
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, **auth)
    try:
        names = list(client.scan_iter(match=pattern, count=1000))
        for i in range(0, len(names), 1000):
            client.unlink(*names[i : i + 1000])
        return len(names)
    finally:
        client.close()


def key_pattern(prefix: str) -> str:
    """A SCAN pattern matching exactly the keys that start with `prefix`."""
    special = "*?[]\\"
    return "".join("\\" + c if c in special else c for c in prefix) + "*"
