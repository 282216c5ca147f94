"""A small real 3D-parallel gloo workload with fault injection, for the diagnostics tests.

Each rank runs `steps` steps of: data wait, a GPipe pipeline over `micro` micro-batches (recv
activation from the previous stage, a matmul "forward" with a tp all-reduce inside it, send to
the next stage; then the backward the other way), a dp all-reduce of the "gradients", and an
optimizer update -- every part in a timer span, as the trainer does. Faults: `--slow-rank`
sleeps longer in its forward; `--stop-rank` stops itself with SIGSTOP inside a step;
`--skip-rank` skips one tp all-reduce (and so falls out of step with its group).

Run: python tests/diagnostics/workload.py --rank R --world W --port P --run-dir D --layout 1,2,2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megascale.diagnostics.timers import Timers, set_timers
from megascale.diagnostics.watchdog import Watchdog
from megascale.layout.grid import RankGrid


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--layout", default="1,2,2", help="pp,dp,tp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--compute-s", type=float, default=0.01)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-s", type=float, default=0.02)
    p.add_argument("--stop-rank", type=int, default=-1)
    p.add_argument("--skip-rank", type=int, default=-1)
    p.add_argument("--fault-step", type=int, default=2)
    p.add_argument("--hang-timeout", type=float, default=120.0)
    a = p.parse_args()

    grid = RankGrid(*(int(v) for v in a.layout.split(",")))
    assert grid.world_size == a.world
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world, timeout=timedelta(seconds=90)
    )
    groups = {}
    for dim in ("tp", "dp"):
        for members in grid.groups(dim):
            pg = dist.new_group(members)
            if a.rank in members:
                groups[dim] = pg
    coords = grid.coords(a.rank)._asdict()
    host = f"node{a.rank // a.ranks_per_host}"
    timers = Timers(a.rank, coords, host, a.run_dir)
    set_timers(timers)
    watchdog = Watchdog(timers, a.run_dir, a.hang_timeout, grid=grid, poll_s=0.2).start()
    stage, prev_rank, next_rank = coords["pp"], None, None
    if stage > 0:
        prev_rank = grid.rank_of(stage - 1, coords["dp"], coords["tp"])
    if stage < grid.pp - 1:
        next_rank = grid.rank_of(stage + 1, coords["dp"], coords["tp"])
    torch.manual_seed(a.rank)
    weight = torch.randn(64, 64)
    act = torch.zeros(8, 64)
    skipped: list[int] = []

    def all_reduce(t: torch.Tensor, dim: str, step: int) -> None:
        if grid.group_size(dim) == 1:
            return
        if dim == "tp" and a.rank == a.skip_rank and step == a.fault_step and not skipped:
            skipped.append(step)
            return  # the injected fault: this rank never joins this one call
        with timers.span(f"all_reduce_{dim}", "comm", op="all_reduce", group=dim):
            dist.all_reduce(t, group=groups[dim])

    def p2p(op: str, t: torch.Tensor, peer: int) -> None:
        with timers.span(op, "p2p", op=op, peer=peer, group="pp"):
            (dist.send if op == "send" else dist.recv)(t, peer)

    def compute(name: str, step: int, slow: float = 0.0) -> torch.Tensor:
        with timers.span(name, "compute"):
            out = torch.tanh(act @ weight)
            time.sleep(a.compute_s + slow)
            if a.rank == a.stop_rank and step == a.fault_step:
                os.kill(os.getpid(), signal.SIGSTOP)
            all_reduce(out, "tp", step)
            return out

    for step in range(a.steps):
        with timers.span("data", "data"):
            time.sleep(0.002)
        for direction, src, dst in (("forward", prev_rank, next_rank), ("backward", next_rank, prev_rank)):
            for _ in range(a.micro):
                if src is not None:
                    p2p("recv", act, src)
                slow = a.slow_s if (a.rank == a.slow_rank and direction == "forward") else 0.0
                out = compute(direction, step, slow)
                if dst is not None:
                    p2p("send", out, dst)
        grad = weight.clone()
        all_reduce(grad, "dp", step)
        with timers.span("optimizer", "optimizer"):
            weight.add_(grad, alpha=-1e-6)
        totals = timers.end_step(step)
        if a.rank == 0:
            with open(os.path.join(a.run_dir, "metrics.jsonl"), "a") as f:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "loss": 3.0 - 0.1 * step,
                            "mfu": 0.01,
                            "tokens_per_s": 1000.0,
                            "step_time": totals["step"],
                        }
                    )
                    + "\n"
                )
    watchdog.stop()
    timers.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
