"""Expert parallelism: each MoE layer's experts split over an ep group carved from dp.

Layout (`RankGrid.expert_groups_of`): ep consecutive dp ranks form an ep group; rank j of it
holds experts `[j * E/ep, (j+1) * E/ep)` of every MoE layer (names unchanged, the others are
dropped before materialization, so they never take memory). Every rank still routes its own
tokens (its dp share of the batch). The dispatcher sends each expert's rows -- already sorted by
expert, so by destination rank -- to the rank holding it with one all-to-all of variable splits,
runs the local experts over the rows it received (grouped by local expert), and sends the
results back with the inverse all-to-all; backward is the same two all-to-alls reversed (gloo
has `all_to_all_single` with uneven splits: checked, used as is). The row counts travel first, in
a small all-to-all of E integers.

Gradients: dense parameters are replicated over dp and ZeRO-sharded over it as before; expert
parameters are replicated over the expert-data group (ranks with the same experts, dp / ep of
them) and ZeRO-sharded over that (`ExpertGradSync`). Their `ShardSpec` names the ep group as
holding other experts, so the global gradient norm adds the experts of every ep rank once.

The balancing statistics (expert loads for the DeepSeek-V3 bias and the metrics) are summed
over dp -- every rank that routes tokens -- so every rank moves the bias alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from megascale.config.fields import ConfigError
from megascale.config.schema import JobConfig
from megascale.diagnostics.timers import get_timers
from megascale.layout.shard import set_shard_spec, shard_spec
from megascale.model.moe import ExpertsFn, MoE, is_expert_parameter, moe_layers
from megascale.parallel.zero import ZeroGradSync


class _AllToAll(Function):
    """Rows `x` split `send` ways out, `recv` rows in; backward the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with get_timers().span("ep.all_to_all", kind="comm", op="all_to_all", group="ep"):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Received rows come as blocks (source rank s, local expert j), source-major, `recv[s, j]`
    rows each; the indices that put them local-expert-major (each expert's rows together)."""
    sizes = recv.t().reshape(-1)  # blocks in (j, s) order
    starts = (recv.reshape(-1).cumsum(0) - recv.reshape(-1)).view_as(recv).t().reshape(-1)
    block_of_row = torch.repeat_interleave(torch.arange(sizes.numel(), device=recv.device), sizes)
    first_row = (sizes.cumsum(0) - sizes)[block_of_row]
    return starts[block_of_row] + torch.arange(block_of_row.numel(), device=recv.device) - first_row


class ExpertParallelDispatch:
    """`MoE.dispatcher` of an ep rank: rows out to the experts' ranks, results back."""

    def __init__(self, group: dist.ProcessGroup, ep: int) -> None:
        self.group, self.ep = group, ep

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[E] rows this rank sends to each expert -> [ep, E/ep] rows each source sends to each
        of this rank's experts."""
        recv = torch.empty_like(counts)
        with get_timers().span("ep.all_to_all", kind="comm", op="all_to_all", group="ep"):
            dist.all_to_all_single(recv, counts, group=self.group)
        return recv.view(self.ep, -1)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: ExpertsFn) -> torch.Tensor:
        recv = self.exchange_counts(counts)
        send_rows = counts.view(self.ep, -1).sum(1).tolist()
        recv_rows = recv.sum(1).tolist()
        received = _AllToAll.apply(x, send_rows, recv_rows, self.group)
        order = expert_major(recv)
        y = experts(received[order], recv.sum(0).tolist())
        back = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
        return _AllToAll.apply(y[back], recv_rows, send_rows, self.group)


def check_expert_layout(model: nn.Module, ep: int) -> None:
    """Every MoE layer splits into ep equal sets of whole experts (checked before any collective)."""
    for layer in moe_layers(model):
        if layer.num_experts % ep:
            raise ConfigError(f"parallel.ep={ep} must divide model.moe.experts={layer.num_experts}")


def apply_expert_parallel(model: nn.Module, mesh) -> None:
    """Keep this rank's experts of every MoE layer and route through the ep group."""
    ep, rank = mesh.ep_size, mesh.ep_rank
    check_expert_layout(model, ep)
    for layer in moe_layers(model):
        per_rank = layer.num_experts // ep
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        for key in list(layer.experts.keys()):
            if int(key) not in mine:
                del layer.experts[key]
        layer.dispatcher = ExpertParallelDispatch(mesh.ep_group, ep)
        for p in layer.experts.parameters():
            set_shard_spec(p, shard_spec(p).held_apart_over(mesh.ep_group))


class ExpertGradSync:
    """ZeRO-2 of the dense parameters over dp and of the expert parameters over their
    expert-data group: the `grad_sync` of a runner whose model has routed experts."""

    def __init__(self, chunks: list[nn.Module], cfg: JobConfig, mesh) -> None:
        dense = ZeroGradSync(chunks, cfg, mesh, select=lambda name: not is_expert_parameter(name))
        over = (mesh.expert_dp_group, mesh.expert_dp_size, mesh.expert_dp_rank)
        experts = ZeroGradSync(chunks, cfg, mesh, select=is_expert_parameter, over=over)
        self.parts = (dense, experts)

    def before_forward(self, chunk_index: int) -> None:
        for part in self.parts:
            part.before_forward(chunk_index)

    def after_backward(self, chunk_index: int) -> None:
        for part in self.parts:
            part.after_backward(chunk_index)

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def after_step(self) -> None:
        for part in self.parts:
            part.after_step()

    def optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [t for part in self.parts for t in part.optimizer_tensors()]

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def wait_params(self) -> None:
        for part in self.parts:
            part.wait_params()


def balance_reducer(mesh):
    """Sum of the routing statistics over every rank that routes its own tokens (dp)."""
    def reduce(stats: torch.Tensor) -> torch.Tensor:
        if mesh is not None and mesh.dp_group is not None:
            stats = stats.to(mesh.device)
            dist.all_reduce(stats, group=mesh.dp_group)
        return stats
    return reduce


__all__ = ["ExpertGradSync", "ExpertParallelDispatch", "MoE", "apply_expert_parallel", "balance_reducer",
           "expert_major"]
