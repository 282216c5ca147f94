"""Self-check diagnostics a node runs before it is trusted again.

Local tests: host memory bandwidth (a large array copy), loopback TCP bandwidth (the network
stack and CPU), a GEMM (on the GPU when there is one), and an all-to-all among `ranks` gloo ranks
of the node. Pair tests with a neighbour node: point-to-point bandwidth (send/recv
both ways) and an all-reduce, over a two-rank group: NCCL between the nodes' GPUs on GPU nodes,
gloo on CPU. Each figure is the best of repeats after a warm-up, each repeat long enough
(`MIN_S`) that a throttled node (a CPU quota acts per scheduling period) shows its real rate.

What a figure is compared with, in order of weight: the other nodes of the same hardware
checked together (`verdict.judge`: below `min_ratio` of their median fails), the
healthy baseline recorded for its hardware type (`megascale selfcheck --measure FILE`: below
`min_ratio` of it fails; the only reference of a node checked alone), and absolute floors as
a backstop, low enough that only a dead or broken node misses them (loopback bandwidth, too
noisy for a ratio, is judged by its floor alone: `FLOOR_ONLY`).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from megascale.config.operations import ResilienceConfig
from megascale.resilience.selfcheck.verdict import FLOOR_ONLY

# Floors a working node of any kind clears even on a machine loaded 10x over its cores (a
# loopback test measured 5.5 MB/s at load 25 here); they catch dead or broken nodes only.
DEFAULT_EXPECTED = {
    "memory_bandwidth": 0.05,
    "loopback_bandwidth": 1.0,
    "gemm": 0.05,
    "all_to_all": 0.2,
    "p2p_bandwidth": 0.2,
    "all_reduce": 0.1,
}
UNITS = {
    "memory_bandwidth": "GB/s",
    "loopback_bandwidth": "MB/s",
    "gemm": "GFLOP/s",
    "all_to_all": "MB/s",
    "p2p_bandwidth": "MB/s",
    "all_reduce": "MB/s",
}
MIN_S, REPEATS = 0.1, 5  # each timed repeat runs at least MIN_S; the best of REPEATS counts


def hardware_type() -> str:
    """What a node's figures may be compared with: its GPU model, or its CPU model and cores."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    model = platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return f"cpu:{model} x{os.cpu_count()}"


def load_expected(path: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(floors, baselines per hardware type) from an expected-figures file ("" = built-in floors).
    A flat {test: figure} file (the old format) gives floors only."""
    floors, baselines = dict(DEFAULT_EXPECTED), {}
    if path:
        data = json.loads(Path(path).read_text())
        if "baseline" in data or "floors" in data:
            floors.update(data.get("floors", {}))
            baselines = data.get("baseline", {})
        else:
            floors.update(data)
    return floors, baselines


def record_baseline(path: str | Path, report: dict[str, Any]) -> dict[str, Any]:
    """Add this healthy node's figures as the baseline of its hardware type (others are kept)."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    if "baseline" not in data and "floors" not in data:
        data = {"floors": data} if data else {}
    data.setdefault("baseline", {})[report["hardware"]] = {
        t["name"]: round(t["value"], 4)
        for t in report["tests"]
        if "error" not in t and "peer" not in t and t["name"] not in FLOOR_ONLY
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def rate(work: Callable[[], float]) -> float:
    """Units per second of `work` (which returns the units it did): a warm-up call, then the
    best of REPEATS timings, each repeating `work` for at least MIN_S. The best, because noise
    (other processes, a busy scheduler) only ever slows a timing, while a slow or throttled
    node is slow in every one."""
    work()
    best = 0.0
    for _ in range(REPEATS):
        done, start = 0.0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < MIN_S:
            done += work()
        best = max(best, done / elapsed)
    return best


def memory_bandwidth(mb: int = 32) -> float:
    src = np.ones(mb * (1 << 20) // 8)
    dst = np.empty_like(src)

    def copy() -> float:
        np.copyto(dst, src)
        return 2 * src.nbytes / 1e9  # read + write

    return rate(copy)


def loopback_bandwidth(mb: int = 4) -> float:
    payload = b"\0" * (1 << 20)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def sink() -> None:
            conn, _ = server.accept()
            with conn:
                while conn.recv(1 << 20):
                    pass

        thread = threading.Thread(target=sink, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as client:

            def send() -> float:
                for _ in range(mb):
                    client.sendall(payload)
                return mb * (1 << 20) / 1e6

            figure = rate(send)
        thread.join(30)
        return figure


def gemm(n: int = 256) -> float:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 4096 if device == "cuda" else n
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def multiply() -> float:
        torch.matmul(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        return 2 * n**3 / 1e9

    return rate(multiply)


def all_to_all(ranks: int, mb: int = 2) -> float:
    """Per-rank bytes leaving it per second in an all-to-all among `ranks` gloo ranks of this
    node (threads of one process: starting a process per rank would cost seconds per check)."""
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    seconds: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("a2a", store), rank, ranks, timedelta(seconds=30))
            x = torch.ones(mb * (1 << 20) // 4)
            y = torch.empty_like(x)
            group.alltoall_base(y, x, [], []).wait()
            start = time.perf_counter()
            group.alltoall_base(y, x, [], []).wait()
            seconds[rank] = time.perf_counter() - start
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors or len(seconds) < ranks:
        raise RuntimeError(f"all-to-all among {ranks} ranks failed: {errors[:1] or 'timed out'}")
    return mb * (1 << 20) * (ranks - 1) / ranks / max(seconds.values()) / 1e6


def pair_backend() -> tuple[str, str]:
    """(backend, device) of the node-to-node tests: NCCL between GPUs where there are GPUs (the
    path training takes over the network), gloo between CPUs otherwise."""
    import torch

    return ("nccl", "cuda") if torch.cuda.is_available() else ("gloo", "cpu")


def join_pair(backend: str, device: str, role: int, master: str, port: int, timeout_s: float) -> None:
    """The 2-rank default group of a pair test, through a store on `master`:`port` that takes no
    connection once both nodes hold one (`sealed_tcp_store`): before, it was open to anyone who
    could reach the port for the whole check."""
    import torch
    import torch.distributed as dist

    from megascale.parallel.store import StoreAddress, sealed_tcp_store

    timeout = timedelta(seconds=timeout_s)
    store = sealed_tcp_store(StoreAddress(master, port, "selfcheck", 0), 2, role == 0, timeout)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=role, world_size=2, timeout=timeout)


def pair_tests(peer: str, role: int, master: str, port: int, timeout_s: float, mb: int = 4) -> list[dict]:
    """p2p bandwidth and all-reduce with one neighbour node over a 2-rank group (pair_backend)."""
    import torch
    import torch.distributed as dist

    tests = []
    backend, device = pair_backend()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        join_pair(backend, device, role, master, port, timeout_s)
    except Exception as exc:  # the peer or the link is down: both pair tests fail
        error = f"cannot reach {peer}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return [{"name": n, "peer": peer, "error": error} for n in ("p2p_bandwidth", "all_reduce")]
    try:
        x = torch.ones(mb * (1 << 20) // 4, device=device)

        def exchange() -> float:
            start = time.perf_counter()
            for sender in (0, 1):
                if role == sender:
                    dist.send(x, 1 - role)
                else:
                    dist.recv(x, 1 - role)
            sync()
            return 2 * x.numel() * 4 / (time.perf_counter() - start) / 1e6

        exchange()  # warm-up: connections, buffers
        tests.append(
            {
                "name": "p2p_bandwidth",
                "peer": peer,
                "backend": backend,
                "value": max(exchange() for _ in range(REPEATS)),
            }
        )
        start = time.perf_counter()
        dist.all_reduce(x)
        sync()
        tests.append(
            {
                "name": "all_reduce",
                "peer": peer,
                "backend": backend,
                "value": x.numel() * 4 / (time.perf_counter() - start) / 1e6,
            }
        )
    except Exception as exc:
        tests.append({"name": "all_reduce", "peer": peer, "error": f"{type(exc).__name__}: {exc}"[:300]})
    finally:
        dist.destroy_process_group()
    return tests


def run_checks(node_id: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Every test of `plan` (see driver/selfcheck_plan.build); a test's failure never stops the rest.
    Each figure is checked against its floor and its hardware's baseline here; against the
    other nodes by the judge (`verdict.judge`)."""
    expected, baselines = load_expected(plan.get("expected_file", ""))
    hardware = hardware_type()
    baseline = baselines.get(hardware, {})
    ratio = plan.get("min_ratio", ResilienceConfig().selfcheck_min_ratio)
    tests: list[dict[str, Any]] = []
    local = [("memory_bandwidth", memory_bandwidth), ("loopback_bandwidth", loopback_bandwidth), ("gemm", gemm)]
    if plan.get("ranks", 1) > 1:
        local.append(("all_to_all", lambda: all_to_all(plan["ranks"])))
    for name, fn in local:
        tests.append(_measured(name, fn))
    for pair in plan.get("pairs", []):
        tests += pair_tests(pair["peer"], pair["role"], pair["master"], pair["port"], plan.get("pair_timeout_s", 15.0))
    for test in tests:
        test.setdefault("value", 0.0)
        test["unit"] = UNITS[test["name"]]
        test["expected"] = expected[test["name"]]
        by_baseline = "peer" not in test and test["name"] not in FLOOR_ONLY  # links: by the fleet
        if test["name"] in baseline and by_baseline:
            test["expected"] = max(test["expected"], ratio * baseline[test["name"]])
            test["baseline"] = baseline[test["name"]]
        test["passed"] = "error" not in test and test["value"] >= test["expected"]
    failed = [t for t in tests if not t["passed"]]
    return {
        "node": node_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "hardware": hardware,
        "passed": not failed,
        "failed": [f"{node_id}: {t['name']}" + (f" with {t['peer']}" if "peer" in t else "") for t in failed],
        "tests": tests,
    }


def _measured(name: str, fn) -> dict[str, Any]:
    try:
        return {"name": name, "value": float(fn())}
    except Exception as exc:
        return {"name": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
