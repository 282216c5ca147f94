"""The small collectives outside the big engines are comm spans: a rank's wait in them for a slow
peer is not its own work (the fail-slow rule's input) and the hang analysis sees them.

Two gloo ranks; rank 1 sleeps before each collective. Rank 0 calls each one inside a `forward`
span, as MoE's routing counts over tp run: the span's self time must stay far below the wait."""

from __future__ import annotations

import time

import torch

from megascale.config.schema import ParallelConfig
from megascale.diagnostics.timers import Timers, set_timers
from megascale.parallel.context import sum_grads_over
from megascale.parallel.expert import balance_reducer, sequence_groups, summed_over
from megascale.parallel.mesh import init_mesh
from megascale.testing.launch import run_local

DELAY_S = 0.4


def _rank(out_dir: str) -> dict:
    mesh = init_mesh(ParallelConfig(tp=2), device="cpu")
    try:
        timers = Timers(mesh.rank, {"tp": mesh.tp_rank}, "test", out_dir, enabled=True)
        set_timers(timers)
        grad = torch.nn.Parameter(torch.zeros(3))
        grad.grad = torch.full((3,), float(mesh.rank + 1))
        calls = {
            "sequence_sum": lambda: summed_over(sequence_groups(mesh, sequence_parallel=True), mesh.device)(
                torch.ones(4)
            ),
            "sum_grads_over": lambda: sum_grads_over([("w", grad)], mesh.tp_group),  # as over cp: any group
            "balance_reducer": lambda: balance_reducer(mesh, sequence_parallel=True)(torch.ones(2)),
        }
        self_s = {}
        for name, call in calls.items():
            if mesh.rank == 1:
                time.sleep(DELAY_S)
            with timers.span("forward", kind="compute"):
                call()
            totals = timers.end_step(len(self_s) + 1)
            self_s[name] = (totals["compute"], totals["comm"])
        timers.close()
        return {"self": self_s, "grad": grad.grad.tolist()}
    finally:
        mesh.destroy()


def test_a_wait_in_the_small_collectives_is_comm_not_work(tmp_path):
    fast, _ = run_local(_rank, 2, (str(tmp_path),), timeout_s=120)
    assert fast["grad"] == [3.0, 3.0, 3.0]  # summed, not just timed
    for name, (compute, comm) in fast["self"].items():
        assert comm > DELAY_S / 2 and compute < DELAY_S / 4, (name, compute, comm)
