"""Simulated diagnostics inputs of a whole job: every rank's timer file and hang dump.

Why: the analysers (store, stragglers, hang graph, figures, traces) must hold at 12,288 ranks
and nothing here can run 12,288 ranks. The files are written by the real writers -- `Timers`
(`record()` intervals closed by `end_step(step, end)`) and `Watchdog.check()` on open spans --
so their format is the one the analysers read in a real run; only the times are made up.

A step of a rank is what interleaved-free 1F1B leaves in the timers: a data wait, then per
micro-batch a forward and a backward compute span, each with two tensor-parallel all-reduces
nested in it and a pipeline receive and send beside it, then the dp reduce-scatter, the
optimizer and the dp all-gather. One rank (`slow_rank`) computes `slow_factor` times slower.
Ranks are placed `ranks_per_host` to a host in rank order (a tp group on one machine).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from megascale.diagnostics.timers import Timers
from megascale.diagnostics.watchdog import Watchdog
from megascale.layout.grid import RankGrid


@dataclass(frozen=True)
class TraceShape:
    grid: RankGrid
    steps: int = 5
    micro_batches: int = 2
    ranks_per_host: int = 8
    slow_rank: int = 0
    slow_factor: float = 1.2
    compute_s: float = 0.010  # one forward's compute; backward is twice that
    jitter: float = 0.02  # uniform relative noise on every span
    seed: int = 0

    def host(self, rank: int) -> str:
        return f"node{rank // self.ranks_per_host:05d}"

    @property
    def spans_per_step(self) -> int:
        return 5 + 10 * self.micro_batches  # data, 2 dp, optimizer, the step row; 10 per mb


def write_timer_files(run_dir: str | Path, shape: TraceShape) -> int:
    """RUN_DIR/timers/rankNNNNN.jsonl for every rank of the grid; returns the spans written."""
    g = shape.grid
    origin = time.perf_counter()
    written = 0
    for rank in range(g.world_size):
        rng = random.Random(shape.seed * 1_000_003 + rank)
        coords = g.coords(rank)._asdict()
        slow = shape.slow_factor if rank == shape.slow_rank else 1.0
        timers = Timers(rank, coords, shape.host(rank), run_dir)
        t = origin
        for step in range(shape.steps):
            t = _one_step(timers, shape, rng, slow, t)
            timers.end_step(step, t)
            written += shape.spans_per_step
        timers.close()
    return written


def _one_step(timers: Timers, shape: TraceShape, rng: random.Random, slow: float, t: float) -> float:
    """Record one step's spans from perf-counter time `t`; returns when the step ended."""

    def span(name: str, kind: str, dur: float, **attrs: object) -> float:
        dur *= rng.uniform(1 - shape.jitter, 1 + shape.jitter)
        timers.record(name, kind, t, t + dur, **attrs)
        return dur

    t += span("next_batch", "data", 0.0005)
    for mb in range(shape.micro_batches):
        for phase, cost, peer_dir in (("forward", 1.0, -1), ("backward", 2.0, 1)):
            t += span(f"recv_{phase}", "p2p", 0.0004, op="recv", peer=peer_dir, mb=mb)
            compute = shape.compute_s * cost * slow
            start = t
            total = span(phase, "compute", compute * 1.2, mb=mb)  # 20% of it in tp all-reduces
            for k in (1, 2):
                t = start + total * (0.4 * k)
                span("all_reduce", "comm", compute * 0.1, op="all_reduce", group="tp")
            t = start + total
            t += span(f"send_{phase}", "p2p", 0.0004, op="send", peer=-peer_dir, mb=mb)
    t += span("reduce_scatter", "comm", 0.004, op="reduce_scatter", group="dp")
    t += span("step", "optimizer", 0.002)
    t += span("all_gather", "comm", 0.004, op="all_gather", group="dp")
    return t


def write_hang_dumps(run_dir: str | Path, grid: RankGrid, stuck: int, ranks_per_host: int = 8) -> int:
    """The watchdog dumps of a job in which rank `stuck` stopped (SIGSTOP: it writes none)
    during the gradient sync: its tp peers wait in their tp all-reduce, the other stages of its
    dp replica in the pipeline receive from the neighbour towards it, every other replica in
    the dp reduce-scatter. Every rank writes its roll call. Returns the dumps written."""
    s = grid.coords(stuck)
    written = 0
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        timers = Timers(rank, c._asdict(), f"node{rank // ranks_per_host:05d}", None)
        dog = Watchdog(timers, run_dir, timeout_s=0.0, grid=grid, poll_s=3600.0)
        dog.start()
        dog.stop()
        if rank == stuck:
            continue
        step = timers.span("train_step", "compute")
        step.__enter__()
        if c.dp == s.dp and c.pp == s.pp:
            wait = timers.span("all_reduce", "comm", op="all_reduce", group="tp")
        elif c.dp == s.dp:
            towards = c.pp - 1 if c.pp > s.pp else c.pp + 1
            wait = timers.span("recv", "p2p", op="recv", peer=grid.rank_of(towards, c.dp, c.tp))
        else:
            wait = timers.span("reduce_scatter", "comm", op="reduce_scatter", group="dp")
        wait.__enter__()
        if dog.check() is not None:
            written += 1
    return written
