"""Start-up benchmark (issue 10): group creation schemes and rendezvous stores, side by side.

Part 1 -- the full (pp, dp, tp) mesh on CPU/gloo, processes on this machine, world 4, 8, 16:
  naive-tcp    Megatron-LM style: every rank enters `new_group` for every group of the job and
               each creation ends with a store barrier over the whole world (PyTorch < 2.1
               behaviour, restored here with TORCH_DIST_INIT_BARRIER=1). Kept only here.
  local-tcp    megascale's `init_mesh`: each rank creates only its own groups, no global barrier
  local-redis  the same on the Redis store
Time is from a common start line (all ranks imported and waiting) to the last rank done;
store operations are counted per rank by `CountingStore`.

Part 2 -- store load: simulated ranks (threads, up to 256 per process, one client each, connected
before the clock starts) do the start-up's pattern (publish an address, read 7 peers' addresses,
join a global barrier) against a TCPStore (hosted alone in a process, as torchrun's agent does)
and a redis-server, for worlds 256, 1024, 4096. Besides wall time it records each server's CPU
seconds in the timed window: on a small machine the clients' own CPU dominates wall time, while
the server's CPU is what a real cluster (one client per host core) would queue behind.

    python bench/startup.py [--reps 2] [--worlds 4 8 16] [--load-worlds 256 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megascale.config import ParallelConfig
from megascale.layout.grid import DIMS, Dim, RankGrid
from megascale.parallel.mesh import create_groups, init_mesh, join_world
from megascale.parallel.redis_store import RedisStore
from megascale.resilience.common.redis_server import RedisServer
from megascale.testing.launch import run_local

LAYOUTS = {4: (1, 2, 2), 8: (2, 2, 2), 16: (4, 2, 2)}  # (pp, dp, tp)
SCHEMES = ("naive-tcp", "local-tcp", "local-redis")
TIMEOUT = timedelta(seconds=300)


def create_groups_naive(grid: RankGrid, dims: tuple[Dim, ...] = DIMS) -> int:
    """Every rank creates every group, with a global store barrier after each; returns count.

    Same skip rules as the project (size-1, world-sized and duplicate groups are not created),
    so the only differences measured are the global barrier and who enters each creation.
    """
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    made: set[tuple[int, ...]] = set()
    try:
        for dim in dims:
            for ranks in grid.groups(dim):
                if len(ranks) in (1, grid.world_size) or tuple(ranks) in made:
                    continue
                made.add(tuple(ranks))
                dist.new_group(ranks, timeout=TIMEOUT)
    finally:
        del os.environ["TORCH_DIST_INIT_BARRIER"]
    return len(made)


def creation_ops(layout: tuple[int, int, int], dims: tuple[Dim, ...]) -> dict:
    """One rank: store ops and barriers of creating `dims` locally, then the naive way.

    Both phases run on one default group (TCPStore), so the world's rendezvous is not counted.
    """
    grid = RankGrid(*layout)
    rank = int(os.environ["RANK"])
    cfg = _config(layout, "tcp", "")
    counter = join_world(cfg, rank, grid.world_size, "gloo", TIMEOUT)
    try:
        out = {}
        for phase in ("local", "naive"):
            counter.reset()
            if phase == "local":
                _, created = create_groups(grid, rank, TIMEOUT, dims)
            else:
                created = create_groups_naive(grid, dims)
            out[phase] = {"ops": counter.total_ops, "barriers": counter.barriers, "groups": created}
        return out
    finally:
        dist.destroy_process_group()


def startup_rank(gate_port: int, scheme: str, layout: tuple[int, int, int], url: str) -> dict:
    """One rank of one timed start-up: wait at the gate, build the mesh, check it, report."""
    gate = dist.TCPStore("127.0.0.1", gate_port, is_master=False, wait_for_workers=False)
    gate.add("ready", 1)
    gate.wait(["go"])
    cfg = _config(layout, "redis" if scheme.endswith("redis") else "tcp", url)
    if scheme.startswith("naive"):
        os.environ["TORCH_DIST_INIT_BARRIER"] = "1"  # the init barrier of that era too
        counter = join_world(cfg, int(os.environ["RANK"]), RankGrid.of(cfg).world_size, "gloo", TIMEOUT)
        created = create_groups_naive(RankGrid(*layout))
        ops, barriers = counter.total_ops, counter.barriers
    else:
        mesh = init_mesh(cfg, device="cpu")
        s = mesh.startup
        ops, barriers, created = s.total_store_ops, s.barriers, s.groups_created
    t1 = time.time()
    check = torch.ones(1)
    dist.all_reduce(check)  # a broken start-up must not look fast
    assert int(check.item()) == RankGrid.of(cfg).world_size
    dist.destroy_process_group()  # the store (counter/mesh) stays referenced until here
    return {"t1": t1, "ops": ops, "barriers": barriers, "groups": created}


def gated_run(world: int, scheme: str, layout: tuple[int, int, int], url: str) -> tuple[float, list[dict]]:
    """Run `startup_rank` on `world` processes, released together once all are ready.

    Returns the release time (the common start line) and every rank's report.
    """
    gate = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    released: list[float] = []

    def release() -> None:
        while gate.add("ready", 0) < world:
            time.sleep(0.05)
        released.append(time.time())
        gate.set("go", "1")

    opener = threading.Thread(target=release, daemon=True)
    opener.start()
    # The launcher hosts the TCPStore, as torchrun's agent does, so no rank races its start.
    env = {"MASTER_PORT": str(gate.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    results = run_local(startup_rank, world, (gate.port, scheme, layout, url), env, timeout_s=600)
    return released[0], results


def bench_mesh(worlds: list[int], reps: int, url: str) -> list[dict]:
    rows = []
    for world in worlds:
        layout = LAYOUTS[world]
        times: dict[str, list[float]] = {s: [] for s in SCHEMES}
        per_rank: dict[str, dict] = {}
        for rep in range(reps):
            for scheme in SCHEMES:  # interleaved, so machine noise hits all schemes alike
                start, res = gated_run(world, scheme, layout, url)
                times[scheme].append(max(r["t1"] for r in res) - start)
                per_rank[scheme] = {
                    "ops_mean": statistics.mean(r["ops"] for r in res),
                    "ops_max": max(r["ops"] for r in res),
                    "barriers": res[0]["barriers"],
                    "groups_per_rank": res[0]["groups"],
                }
                print(f"  world {world} rep {rep} {scheme}: {times[scheme][-1]:.3f}s", flush=True)
        for scheme in SCHEMES:
            rows.append(
                {
                    "world": world,
                    "layout_pp_dp_tp": layout,
                    "scheme": scheme,
                    "time_s": statistics.median(times[scheme]),
                    "times_s": times[scheme],
                    **per_rank[scheme],
                }
            )
    return rows


# -- part 2: store load ------------------------------------------------------------------------
GROUP = 8  # peers whose address each simulated rank reads (its tp/dp neighbourhood)
THREADS_PER_PROC = 256  # simulated ranks per worker process, at most


def _client(kind: str, addr: str, prefix: str) -> dist.Store:
    if kind == "redis":
        return RedisStore(addr, prefix=prefix, timeout=TIMEOUT)
    host, port = addr.split(":")
    tcp = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    return dist.PrefixStore(prefix, tcp)


def _simulated_rank(store: dist.Store, rank: int, world: int, go: threading.Event, done: list[float]) -> None:
    go.wait()
    store.set(f"addr/{rank}", os.urandom(64))
    base = rank // GROUP * GROUP
    for peer in range(base, min(base + GROUP, world)):
        if peer != rank:
            store.get(f"addr/{peer}")
    if store.add("barrier", 1) == world:
        store.set("barrier/done", b"1")
    store.wait(["barrier/done"])
    done.append(time.time())


def _load_worker(
    kind: str,
    addr: str,
    prefix: str,
    ranks: list[int],
    world: int,
    ready: mp.Queue,
    go: mp.Event,
    out: mp.Queue,
) -> None:
    # Set-up, untimed: connect one client after the other. Thousands of Python threads
    # connecting at once on two cores starve each other (and the server) past the clients'
    # 5 s connect timeouts; on a cluster each rank connects from its own host.
    # (The GIL's switch interval stays at its 5 ms default: 0.5 ms made both stores slower at
    # 256 threads per process, Redis at 1024 ranks 8.6-11.9 s against 5.2-5.7 s.)
    stores = [_client(kind, addr, prefix) for _ in ranks]
    local_go = threading.Event()
    done: list[float] = []
    threads = [
        threading.Thread(target=_simulated_rank, args=(store, r, world, local_go, done), daemon=True)
        for store, r in zip(stores, ranks, strict=True)
    ]
    for t in threads:
        t.start()
    ready.put(len(ranks))
    go.wait()
    local_go.set()
    for t in threads:
        t.join()
    out.put(max(done))


def _collect(results: mp.Queue, workers: list[mp.Process], timeout_s: float) -> list:
    """One item per worker from `results`; fails at once when a worker dies instead."""
    items, deadline = [], time.monotonic() + timeout_s
    while len(items) < len(workers):
        try:
            items.append(results.get(timeout=1))
        except queue.Empty as empty:
            dead = [w.pid for w in workers if w.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for w in workers:
                    w.kill()
                raise RuntimeError(f"load workers failed (pids {dead}) or timed out after {timeout_s:.0f}s") from empty
    return items


def _host_tcp_store(port: mp.Queue, stop: mp.Event) -> None:
    """A TCPStore server alone in its process, as torchrun's agent hosts it, so its CPU is its own."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port.put(server.port)
    stop.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_test(kind: str, addr: str, server_pid: int, prefix: str, world: int) -> dict:
    """One run: seconds from release to the last simulated rank through the barrier, the
    store server's CPU seconds in that window, and the (untimed) client set-up seconds."""
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = -(-world // THREADS_PER_PROC)
    shards = [list(range(world))[i::procs] for i in range(procs)]
    workers = [ctx.Process(target=_load_worker, args=(kind, addr, prefix, s, world, ready, go, out)) for s in shards]
    t0 = time.time()
    for w in workers:
        w.start()
    _collect(ready, workers, 1800)
    setup = time.time() - t0
    cpu0, start = cpu_seconds(server_pid), time.time()
    go.set()
    end = max(_collect(out, workers, 600))
    cpu = cpu_seconds(server_pid) - cpu0  # the window is over once every worker has reported
    for w in workers:
        w.join()
    return {"time_s": end - start, "server_cpu_s": cpu, "setup_s": setup, "procs": procs}


def bench_load(worlds: list[int], reps: int, server: RedisServer) -> Iterator[list[dict]]:
    """Yields each world's rows as soon as that world is done (4096 takes minutes to set up)."""
    ctx = mp.get_context("spawn")
    port, stop = ctx.Queue(), ctx.Event()
    host = ctx.Process(target=_host_tcp_store, args=(port, stop), daemon=True)
    host.start()
    stores = {"tcp": (f"127.0.0.1:{port.get(timeout=120)}", host.pid), "redis": (server.url, server.pid)}
    try:
        for world in worlds:
            runs: dict[str, list[dict]] = {"tcp": [], "redis": []}
            for rep in range(reps if world < 4096 else 1):
                for kind, (addr, pid) in stores.items():
                    run = load_test(kind, addr, pid, f"load/{world}/{rep}/", world)  # fresh keys per run
                    runs[kind].append(run)
                    print(
                        f"  load world {world} rep {rep} {kind}: {run['time_s']:.3f}s, server CPU "
                        f"{run['server_cpu_s']:.2f}s (set-up {run['setup_s']:.0f}s)",
                        flush=True,
                    )
            yield [
                {
                    "world": world,
                    "store": kind,
                    "time_s": statistics.median(r["time_s"] for r in rs),
                    "times_s": [r["time_s"] for r in rs],
                    "server_cpu_s": statistics.median(r["server_cpu_s"] for r in rs),
                    "setup_s": [r["setup_s"] for r in rs],
                    "client_procs": rs[0]["procs"],
                    "ops_per_rank": GROUP + 2,
                }
                for kind, rs in runs.items()
            ]
    finally:
        stop.set()
        host.join(timeout=10)


def _config(layout: tuple[int, int, int], store: str, url: str) -> ParallelConfig:
    pp, dp, tp = layout
    return ParallelConfig(pp=pp, dp=dp, tp=tp, store=store, redis_url=url or "redis://x:1/0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--reps", type=int, default=2, help="repetitions (load world 4096: once)")
    parser.add_argument("--load-worlds", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup.json"))
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["mesh", "load"],
        default=["mesh", "load"],
        help="run only some parts; the others' results in --out are kept",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update({"torch": torch.__version__, "cpus": os.cpu_count(), "loopback_reverse_dns": loopback_reverse_dns()})
    with RedisServer() as server:
        if "mesh" in args.parts:
            print("mesh start-up (CPU, gloo):", flush=True)
            result["mesh"] = bench_mesh(args.worlds, args.reps, server.url)
            result["mesh_date"] = time.strftime("%Y-%m-%d %H:%M:%S")
            _write(out, result)
        if "load" in args.parts:
            print("store load (simulated ranks):", flush=True)
            # Each TCPStore client logs a warning when reverse DNS of its own address fails; at
            # thousands of clients that floods the terminal and hides the figures.
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            result["load"] = []
            result["load_date"] = time.strftime("%Y-%m-%d %H:%M:%S")
            for rows in bench_load(args.load_worlds, args.reps, server):
                result["load"] += rows
                _write(out, result)
    print_tables(result.get("mesh", []), result.get("load", []))


def loopback_reverse_dns() -> str:
    """How the TCPStore client's own address resolves; it looks it up on every connect.

    The client logs its socket as [::ffff:127.0.0.1]:port and resolves that name first. Where
    /etc/hosts lacks the v4-mapped form the query goes to DNS, and a resolver that drops queries
    stalls a connect by 5 s: a start-up time of the DNS, not of the store.
    """
    t0 = time.perf_counter()
    try:
        name = socket.getnameinfo(("::ffff:127.0.0.1", 0, 0, 0), socket.NI_NAMEREQD)[0]
    except OSError as exc:
        name = f"unresolved ({exc})"
    how = f"{name} in {(time.perf_counter() - t0) * 1e3:.1f} ms"
    if name.startswith("unresolved"):
        print(
            f"warning: reverse DNS of ::ffff:127.0.0.1 is {how}; TCPStore connects may stall 5 s "
            "when the DNS drops queries (docs/troubleshooting.md)",
            flush=True,
        )
    return how


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", flush=True)


def print_tables(mesh_rows: list[dict], load_rows: list[dict]) -> None:
    if mesh_rows:
        print_mesh_table(mesh_rows)
    if load_rows:
        print_load_table(load_rows)


def print_mesh_table(mesh_rows: list[dict]) -> None:
    print(
        f"\n{'world':>5} {'scheme':<12} {'time s':>7} {'vs naive':>8} {'ops/rank':>9} "
        f"{'max ops':>8} {'barriers':>8} {'groups':>6}"
    )
    naive = {r["world"]: r["time_s"] for r in mesh_rows if r["scheme"] == "naive-tcp"}
    for r in mesh_rows:
        ratio = naive[r["world"]] / r["time_s"] if r["time_s"] else float("nan")
        print(
            f"{r['world']:>5} {r['scheme']:<12} {r['time_s']:>7.3f} {ratio:>7.2f}x "
            f"{r['ops_mean']:>9.1f} {r['ops_max']:>8} {r['barriers']:>8} "
            f"{r['groups_per_rank']:>6}"
        )


def print_load_table(load_rows: list[dict]) -> None:
    print(f"\n{'world':>5} {'tcp s':>8} {'redis s':>8} {'tcp/redis':>9} {'tcp srv CPU':>11} {'redis srv CPU':>13}")
    by = {(r["world"], r["store"]): r for r in load_rows}
    for world in sorted({r["world"] for r in load_rows}):
        tcp, red = by[(world, "tcp")], by[(world, "redis")]
        print(
            f"{world:>5} {tcp['time_s']:>8.3f} {red['time_s']:>8.3f} {tcp['time_s'] / red['time_s']:>8.2f}x "
            f"{tcp.get('server_cpu_s', float('nan')):>10.2f}s {red.get('server_cpu_s', float('nan')):>12.2f}s"
        )


if __name__ == "__main__":
    main()
