"""Whole-tensor norms of tensors that may be sharded across process groups.

A tensor that the parallel code splits (a tensor-parallel weight, a ZeRO shard) says in its
`ShardSpec` over which process groups its pieces must be summed. Norms are built
from per-tensor sums of squares reduced over those groups, so a shard never stands in for the
whole parameter: LAMB's trust ratio and gradient clipping see the same numbers as one process.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megascale.layout.shard import shard_spec

# How a partial sum is summed over a process group, in place. The default is the bare collective;
# the trainer passes one timed as communication (`parallel.timed_comm.timed_all_reduce`): the wait for
# a slower peer inside it is not this rank's work, and the fail-slow rule reads that work.
SumOver = Callable[[torch.Tensor, dist.ProcessGroup], object]


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(tensor, group=group)


def whole_sq_norms(
    tensors: Sequence[torch.Tensor], owners: Sequence[torch.Tensor], sum_over: SumOver = all_reduce
) -> torch.Tensor:
    """Squared L2 norm of each whole tensor, in float32 (float64 if any tensor is float64).

    `tensors[i]` is the local piece; `owners[i]` carries the groups it is split over (the
    parameter, when `tensors` are its gradients or updates)."""
    if not tensors:
        return torch.zeros(0)
    # accumulated in float32 (float64 if any piece is), without a float32 copy of bf16 tensors
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    local = torch.stack(torch._foreach_norm([t.detach() for t in tensors], 2, dtype=dtype)).pow(2)
    by_groups: dict[tuple, list[int]] = defaultdict(list)
    for i, owner in enumerate(owners):
        by_groups[shard_spec(owner).groups].append(i)
    for groups, index in by_groups.items():
        if not groups:
            continue
        idx = torch.tensor(index, device=local.device)
        part = local.index_select(0, idx)
        for group in groups:
            sum_over(part, group)
        local = local.index_copy(0, idx, part)
    return local


def global_grad_norm(
    params: Sequence[torch.Tensor], across: Sequence[dist.ProcessGroup | None] = (), sum_over: SumOver = all_reduce
) -> torch.Tensor:
    """L2 norm of all gradients of the model, counting every element exactly once.

    `across` are groups holding disjoint parameters (pipeline stages) whose totals add up; a
    tensor's `ShardSpec.disjoint` names more such groups for its kind (expert parallelism)."""
    with_grad = [p for p in params if p.grad is not None]
    sq = whole_sq_norms([p.grad for p in with_grad if p.grad is not None], with_grad, sum_over)
    apart: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(with_grad):
        apart[shard_spec(p).disjoint].append(i)
    # every kind the parameters have, in one order on every rank, even if no gradient exists here
    kinds = sorted({shard_spec(p).disjoint for p in params}, key=len)
    total = sq.new_zeros(()) if sq.numel() else torch.zeros(())
    for kind in kinds:
        part = sq[apart[kind]].sum() if apart[kind] else total.new_zeros(())
        for group in kind:
            sum_over(part, group)
        total = total + part
    for outer in across:
        if outer is not None:
            sum_over(total, outer)
    return total.sqrt()


def clip_grad_norm_(
    params: Sequence[torch.Tensor], max_norm: float, across: Sequence[dist.ProcessGroup | None] = ()
) -> torch.Tensor:
    """Scale gradients so that their global norm is at most `max_norm`; returns the norm before."""
    norm = global_grad_norm(params, across)
    clip_to_norm_(params, max_norm, norm)
    return norm


def clip_to_norm_(params: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients whose global norm is `norm` (from `global_grad_norm`) to at most `max_norm`."""
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].device))
