"""An all-reduce timed as a `comm` span, for the small collectives outside the big engines.

Why: a collective with no span of its own counts as its enclosing span's self time. Inside
`forward` or `optimizer` a fast rank's wait there for a slow peer then reads as its own work,
and the fail-slow rule (compute + optimizer self time against the peers) sees the fast ranks
nearly as slow as the slow one (the fail-slow regression of issue 32). Outside any span the wait is invisible
to the hang analysis, which finds a waiter's peers by its open comm span and group.
Checked by tests/parallel/test_timed_comm.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megascale.diagnostics.timers import get_timers


def timed_all_reduce(value: torch.Tensor, group: dist.ProcessGroup, mesh=None, dim: str | None = None) -> None:
    """Sum `value` over `group` in place, timed as `{dim}.all_reduce` (kind comm, group `dim`):
    `dim` is the mesh dimension the group spans, given or found by `mesh` (None: not one)."""
    if dim is None and mesh is not None:
        dim = mesh.dim_of(group)
    with get_timers().span(f"{dim or 'group'}.all_reduce", kind="comm", op="all_reduce", group=dim):
        dist.all_reduce(value, group=group)


def reduce_sum(value: torch.Tensor, *groups, mesh=None) -> torch.Tensor:
    """Sum a small CPU/GPU tensor over each group in turn (groups may be None), timed as comm:
    the step's small collectives (loss, grad norm, LAMB's sharded norms) in the `optimizer` span."""
    for group in groups:
        if group is not None:
            timed_all_reduce(value, group, mesh)
    return value
