"""The Redis store: c10d semantics, restart isolation, unreachable server, parity with TCPStore."""

import socket
import threading
import time
from datetime import timedelta

import pytest
import redis
import torch
import torch.distributed as dist

from megascale.config import ConfigError, ParallelConfig, load_config
from megascale.parallel import init_mesh
from megascale.parallel.redis_store import RedisStore, StoreUnreachableError
from megascale.parallel.store import StoreAddress, create_store, free_port
from megascale.testing.launch import run_local, run_with_stores

pytestmark = [pytest.mark.redis, pytest.mark.timeout(900), pytest.mark.slow]  # multi-process rendezvous


def test_semantics_match_c10d(redis_server):
    s = RedisStore(redis_server.url, prefix="sem/", timeout=timedelta(seconds=2))
    s.set("a", b"x")
    assert s.get("a") == b"x"
    assert (s.add("n", 2), s.add("n", 3), s.get("n")) == (2, 5, b"5")
    # compare_set as TCPStore: missing+"" sets; wrong expectation returns the current value;
    # missing with a non-empty expectation returns the expectation and sets nothing
    assert s.compare_set("cs", "", "v1") == b"v1"
    assert s.compare_set("cs", "zz", "v2") == b"v1"
    assert s.compare_set("cs", "v1", "v2") == b"v2"
    assert s.compare_set("missing", "e", "d") == b"e" and not s.check(["missing"])
    s.append("log", b"ab")
    s.append("log", b"cd")
    assert s.get("log") == b"abcd"
    assert s.check(["a", "n"]) and not s.check(["a", "nope"])
    assert s.num_keys() == 4
    assert s.delete_key("a") and not s.delete_key("a")
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="keys \\['never'\\] under prefix 'sem/'"):
        s.get("never")
    assert 1.9 < time.monotonic() - start < 10


def test_blocking_get_and_wait_wake_on_write(redis_server):
    s = RedisStore(redis_server.url, prefix="wake/", timeout=timedelta(seconds=10))
    writer = RedisStore(redis_server.url, prefix="wake/")
    threading.Timer(0.3, writer.set, ("k", b"v")).start()
    threading.Timer(0.5, writer.add, ("c", 1)).start()
    start = time.monotonic()
    assert s.get("k") == b"v"
    s.wait(["k", "c"])
    assert time.monotonic() - start < 6  # woken by the publish, long before the 10 s timeout


def test_attempts_and_jobs_do_not_see_each_others_keys(redis_server):
    cfg = ParallelConfig(store="redis", redis_url=redis_server.url, init_timeout_s=1)
    old = create_store(cfg, 0, 2, StoreAddress("127.0.0.1", 1, "job-a", attempt=0))
    new = create_store(cfg, 0, 2, StoreAddress("127.0.0.1", 1, "job-a", attempt=1))
    other = create_store(cfg, 0, 2, StoreAddress("127.0.0.1", 1, "job-b", attempt=0))
    old.set("rank_0", b"stale address")
    old.add("store_based_barrier_key:1", 3)
    assert not new.check(["rank_0"]) and not other.check(["rank_0"])
    assert new.add("store_based_barrier_key:1", 1) == 1
    with pytest.raises(dist.DistStoreError):
        new.get("rank_0")


def _mesh_sum(pp: int, dp: int, tp: int, url: str, crash_rank: int, timeout_s: float) -> float:
    import os

    if int(os.environ["RANK"]) == crash_rank:
        raise SystemExit("simulated crash before joining")
    cfg = ParallelConfig(
        pp=pp, dp=dp, tp=tp, store="redis", redis_url=url, init_timeout_s=timeout_s, collective_timeout_s=timeout_s
    )
    mesh = init_mesh(cfg, device="cpu")
    t = torch.tensor([float(mesh.rank)])
    dist.all_reduce(t, group=mesh.dp_group)
    dist.all_reduce(t)
    mesh.destroy()
    return t.item()


def _prefix_keys(url: str, pattern: str) -> int:
    return sum(1 for _ in redis.Redis.from_url(url).scan_iter(match=pattern))


@pytest.mark.slow
def test_restart_does_not_pick_up_previous_attempt(redis_server):
    """Attempt 0 dies half-way through rendezvous; attempt 1 on the same server starts clean."""
    job = {"MEGASCALE_JOB_ID": "restart-job"}
    with pytest.raises(RuntimeError, match="ranks .* failed"):
        run_local(
            _mesh_sum,
            4,
            (1, 2, 2, redis_server.url, 3, 4),
            env={**job, "MEGASCALE_RESTART_ATTEMPT": "0"},
            timeout_s=300,
        )
    stale = _prefix_keys(redis_server.url, "megascale/restart-job/attempt0/*")
    assert stale > 0  # the dead attempt left addresses and counters behind
    sums = run_local(
        _mesh_sum, 4, (1, 2, 2, redis_server.url, -1, 120), env={**job, "MEGASCALE_RESTART_ATTEMPT": "1"}, timeout_s=300
    )
    # dp groups {0,2} and {1,3}: (0+2)+(1+3)+(0+2)+(1+3) = 12 after the world all_reduce
    assert sums == [12.0] * 4
    assert _prefix_keys(redis_server.url, "megascale/restart-job/attempt0/*") == stale
    assert _prefix_keys(redis_server.url, "megascale/restart-job/attempt1/*") > 0


def test_unreachable_redis_names_address_within_bound():
    port = free_port()  # nothing listens there
    cfg = ParallelConfig(store="redis", redis_url=f"redis://127.0.0.1:{port}/0", redis_connect_timeout_s=2)
    start = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=f"127.0.0.1:{port}.*within 2s"):
        create_store(cfg, 0, 2, StoreAddress("127.0.0.1", 1, "job", 0))
    assert time.monotonic() - start < 5


def test_silent_redis_host_fails_within_bound():
    """A server that accepts the connection but never answers (hung host) is bounded too."""
    with socket.socket() as sink:
        sink.bind(("127.0.0.1", 0))
        sink.listen(16)
        port = sink.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(StoreUnreachableError, match=f"127.0.0.1:{port}"):
            RedisStore(f"redis://127.0.0.1:{port}/0", connect_timeout_s=2)
        assert time.monotonic() - start < 8


def _parity_run(overrides: list[str], steps: int) -> list[float]:
    """A tiny data-parallel regression: losses must not depend on the store."""
    cfg = load_config(
        None, overrides + [f"--parallel.dp={_world()}", "--train.global_batch=8", "--train.micro_batch=1"]
    )
    mesh = init_mesh(cfg.parallel, device="cpu")
    torch.manual_seed(0)
    w = torch.zeros(4, requires_grad=True)
    g = torch.Generator().manual_seed(100 + mesh.dp_rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = ((x @ w - x.sum(1)) ** 2).mean()
        loss.backward()
        for t in (w.grad, loss.detach()):
            if mesh.dp_group is not None:
                dist.all_reduce(t, group=mesh.dp_group)
                t /= mesh.dp_size
        losses.append(loss.item() if mesh.dp_group is None else float(t))
        with torch.no_grad():
            w -= 0.1 * w.grad
            w.grad = None
    mesh.destroy()
    return losses


def _world() -> int:
    import os

    return int(os.environ["WORLD_SIZE"])


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_redis_and_tcp_store_give_identical_results(redis_server, world):
    out = run_with_stores(_parity_run, world, redis_server.url, args=(5,), timeout_s=300)
    assert out["tcp"] == out["redis"]  # bit-identical, every rank
    assert len({tuple(r) for r in out["tcp"]}) == 1  # the dp ranks agree
    assert out["tcp"][0][-1] < out["tcp"][0][0]  # it did train


def test_namespace_comes_from_job_and_restart_count():
    torchrun = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert StoreAddress.from_env(torchrun).prefix == "megascale/r1/attempt2/"
    ours = {**torchrun, "MEGASCALE_JOB_ID": "j", "MEGASCALE_RESTART_ATTEMPT": "5"}
    assert StoreAddress.from_env(ours).prefix == "megascale/j/attempt5/"
    # Redis needs no MASTER_ADDR/PORT; the TCPStore does, and says so
    assert StoreAddress.from_env({}, need_master=False).prefix == "megascale/job/attempt0/"
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT"):
        StoreAddress.from_env({})


def _sealed_mesh(timeout_s: float) -> tuple[bool, float]:
    """Join a 2-rank TCPStore mesh; then whether a new connection to MASTER_PORT still forms (as
    another local user would make it), and a collective on groups created after the seal."""
    import os

    mesh = init_mesh(ParallelConfig(dp=2, init_timeout_s=timeout_s, collective_timeout_s=timeout_s), device="cpu")
    connects = _still_connects(int(os.environ["MASTER_PORT"]))
    t = torch.tensor([float(mesh.rank + 1)])
    dist.all_reduce(t, group=mesh.checkpoint_groups["dp"])  # a gloo group made through the store now
    mesh.destroy()
    return connects, t.item()


def _still_connects(port: int, within_s: float = 10.0) -> bool:
    """Whether a stranger's connection to `port` (as another local user would make it) still
    forms `within_s` seconds after the members joined."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            time.sleep(0.1)
        except OSError:
            return False
    return True


def _sealed_pair(timeout_s: float) -> tuple[bool, float]:
    """A self-check pair group (`selfcheck.join_pair`, gloo) on MASTER_PORT; then the probe."""
    import os

    from megascale.resilience.selfcheck.checks import join_pair

    role, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    join_pair("gloo", "cpu", role, "127.0.0.1", port, timeout_s)
    connects = _still_connects(port)
    t = torch.tensor([float(role + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return connects, t.item()


def test_the_rendezvous_store_takes_no_connection_once_every_rank_holds_one():
    """Before, rank 0's TCPStore listened on MASTER_PORT for the whole run: any local user could
    connect and rewrite the rendezvous keys. Now, once both ranks are connected, a new connection
    never forms, while groups created later (through the ranks' own connections) still work."""
    assert run_local(_sealed_mesh, 2, (30,), timeout_s=120) == [(False, 3.0)] * 2


def test_a_self_check_pair_store_takes_no_connection_once_both_nodes_hold_one():
    """The pair tests' store (one of each pair of nodes) was open for the whole check to anyone
    who could reach its port; now it is sealed like the rendezvous once both nodes are in."""
    assert run_local(_sealed_pair, 2, (30,), timeout_s=120) == [(False, 3.0)] * 2
