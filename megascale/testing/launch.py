"""Run a function on N local processes with a torchrun-style environment.

Used by the multi-process tests, the start-up benchmark and the store-parity check: each child
gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, one thread, and a deadline; a child that
raises, dies or hangs fails the whole run with that rank's traceback or name.

Children fork from a server process that imported torch and most of the trainer once (multiprocessing's
forkserver, started on the first call and kept), not from a fresh interpreter each: imports were
~70% of the CPU of a 4-rank parity test, and the test suite is CPU-bound. A child gets the
caller's environment as it is at the call, as spawn would give it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from megascale.parallel.store import free_port

# What the fork server imports once: torch, what torch.optim's first parameter group imports
# (torch._dynamo), and most of the trainer's own imports (from the layers below this one).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "megascale.checkpoint.manager",
    "megascale.checkpoint.replica",
    "megascale.parallel.runner",
]


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Call `fn(*args)` on `world_size` local ranks; return their results in rank order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call
    results: mp.Queue = ctx.Queue()
    base = {
        **os.environ,  # the server's environment is the one it started with: send today's
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "MEGASCALE_JOB_ID": uuid.uuid4().hex[:12],  # a fresh key namespace on shared stores
        **(env or {}),
    }
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, args, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    exited: dict[int, float] = {}  # rank -> when it was first seen gone without a result
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if p.exitcode is None or r in out or r in errors:
                        continue
                    if p.exitcode != 0:
                        errors[r] = f"died without a result (exit code {p.exitcode})"
                    elif now - exited.setdefault(r, now) > 2.0:  # a result in flight has landed by now
                        errors[r] = (
                            "exited without a result: it could not be sent (unpicklable? the "
                            "rank's stderr has the queue's error)"
                        )
                continue
            if ok:
                out[rank] = value
            else:
                if not errors:  # others are likely stuck on the failed rank: give them 2 s
                    deadline = min(deadline, time.monotonic() + 2.0)
                errors[rank] = value
        if errors:
            raise RuntimeError(f"ranks {sorted(errors)} failed" + _describe(errors))
        missing = sorted(set(range(world_size)) - set(out))
        if missing:
            raise TimeoutError(f"ranks {missing} did not finish within {timeout_s}s")
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


def run_with_stores(
    fn: Callable[..., Any],
    world_size: int,
    redis_url: str,
    args: tuple = (),
    timeout_s: float = 120.0,
) -> dict[str, list[Any]]:
    """Run `fn(overrides, *args)` on TCPStore, then on Redis; results by store name.

    `overrides` are `--parallel.store=...`/`--parallel.redis_url=...` strings for
    `load_config`, so a training entry point runs unchanged on either store and a parity
    test compares the two result lists.
    """
    out = {}
    for store in ("tcp", "redis"):
        overrides = [f"--parallel.store={store}", f"--parallel.redis_url={redis_url}"]
        out[store] = run_local(fn, world_size, (overrides, *args), timeout_s=timeout_s)
    return out


def _describe(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{errors[r]}" for r in sorted(errors))


def _child(fn: Callable[..., Any], args: tuple, env: dict[str, str], results: mp.Queue) -> None:
    os.environ.clear()
    os.environ.update(env)
    # torch was imported before this rank's environment existed (in the fork server, and again
    # when a bench's __main__ that imports torch is re-imported here): OpenMP read the parent's
    # OMP_NUM_THREADS (unset: every core), and two ranks on two cores ran two threads each
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rank = int(env["RANK"])
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:  # report every failure, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
