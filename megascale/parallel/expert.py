"""Expert parallelism: each MoE layer's experts split over an ep group carved from dp.

Layout (`RankGrid.expert_groups_of`): ep consecutive dp ranks form an ep group; rank j of it
holds experts `[j * E/ep, (j+1) * E/ep)` of every MoE layer (names unchanged, the others are
dropped before materialization, so they never take memory). Every rank still routes its own
tokens (its dp share of the batch). The dispatcher sends each expert's rows -- already sorted by
expert, so by destination rank -- to the rank holding it with one all-to-all of variable splits,
runs the local experts over the rows it received (grouped by local expert), and sends the
results back with the inverse all-to-all; backward is the same two all-to-alls reversed (gloo
has `all_to_all_single` with uneven splits, synchronous and asynchronous: checked, used as is).
The row counts travel first, in a small all-to-all of E integers per part.

Overlap (`parallel.ep_overlap_chunks`, MegaScale-MoE's intra-operator overlap in its simplest
form): a micro-batch's rows are cut into parts, each sorted by expert; part c+1's dispatch and
the combine of part c are issued asynchronously, so they are in flight while part c's (and
then part c+1's) experts compute. Chunking rather than overlapping the shared expert or
attention with the dispatch keeps the model's block unchanged and works whether or not a shared
expert exists.

Backward is pipelined the same way. Each exchange's backward node only issues the reverse
all-to-all of its gradient; a node of its own (`_AwaitGrad`, an identity in forward, placed on
the exchanged tensor's input) waits for it. Autograd's engine runs ready nodes latest-created
first, so the waits are placed in forward where backward reaches them late: the dispatches'
waits before any part's experts, each combine's wait right after its part's experts. Backward
then runs: both combines' gradient exchanges issued, part 1's waited, part 1's experts' backward
(part 0's exchange in flight), part 1's dispatch gradient issued, part 0's experts' backward
(that exchange in flight), part 0's issued, the two waited. The order is the engine's choice,
not a guarantee: were it to change, the waits still come before any use of the gradients,
only the overlap would go (the order test, tests/parallel/test_expert_parallel.py, would say so).

Gradients: dense parameters are replicated over dp and ZeRO-sharded over it as before; expert
parameters are replicated over the expert-data group (ranks with the same experts, dp / ep of
them) and ZeRO-sharded over that (`ExpertGradSync`). Their `ShardSpec` names the ep group as
holding other experts, so the global gradient norm adds the experts of every ep rank once.

The balancing statistics (expert loads for the DeepSeek-V3 bias and the metrics) are summed
over every rank that routes tokens -- dp, cp, and tp under sequence parallelism -- so every
rank moves the bias alike; the balancing loss's per-sequence expert counts over the ranks
holding parts of each sequence (cp, tp under SP: `apply_sequence_sums`).

Context parallelism: each cp rank routes its part of every sequence; an ep group is made of
ranks with the same cp (and tp) rank, so tokens cross only dp; the experts' gradients are summed
over cp with every other gradient (`ModelRunner.finish_grads`).

Tensor parallelism (megascale.parallel.tensor): an MoE layer is not sliced; it runs on the tp
rank's sequence slice under SP (its parameters' gradients are partial, summed over tp like the
norms'; its per-sequence expert counts are summed over tp for the balancing loss), or on the
whole replicated sequence without SP. The ep group is made of ranks with the same tp rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function
from torch.distributed import all_to_all_single  # a module name: the overlap test records its calls

from megascale.config.fields import ConfigError
from megascale.config.schema import JobConfig
from megascale.diagnostics.timers import get_timers
from megascale.layout.shard import set_shard_spec, shard_spec
from megascale.model.moe import ExpertsFn, MoE, is_expert_parameter, moe_layers
from megascale.parallel.timed_comm import timed_all_reduce
from megascale.parallel.zero import ZeroGradSync


class _Pending:
    """A gradient all-to-all issued by an exchange's backward, waited for by its `_AwaitGrad`."""

    def __init__(self) -> None:
        self.work: dist.Work | None = None
        self.sent: torch.Tensor | None = None  # the gradient sent: alive until the exchange is done
        self.received: torch.Tensor | None = None


class _AwaitGrad(Function):
    """Identity on `x`; in backward, waits for `pending`'s exchange and gives what it received
    as `x`'s gradient (the gradient arriving here is that buffer, possibly still being filled)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pending: _Pending) -> torch.Tensor:
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pending = ctx.pending
        assert pending.work is not None and pending.received is not None, "exchange's backward did not run"
        with get_timers().span("ep.all_to_all.backward", kind="comm", op="all_to_all", group="ep"):
            pending.work.wait()
        received, pending.work, pending.sent, pending.received = pending.received, None, None, None
        return received, None


class _Exchanged(Function):
    """`out` (filled by an all-to-all of `x`, rows split `send` ways out and `recv` in) joined
    to `x` in the graph; backward: issues the reverse exchange of the gradient (`pending`; the
    `_AwaitGrad` on `x` waits for it)."""

    @staticmethod
    def forward(ctx, x, out, send: list[int], recv: list[int], group, pending: _Pending) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.pending = send, recv, group, pending
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pending = ctx.pending
        pending.sent = grad.contiguous()
        pending.received = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        pending.work = all_to_all_single(
            pending.received, pending.sent, ctx.send, ctx.recv, group=ctx.group, async_op=True
        )
        return pending.received, None, None, None, None, None


class _InFlight:
    """An all-to-all of rows issued asynchronously; `result()` waits and joins the graph.
    `x` is the output of an `_AwaitGrad` on `pending` (the backward's wait)."""

    def __init__(self, x: torch.Tensor, send: list[int], recv: list[int], group, pending: _Pending) -> None:
        self.x, self.send, self.recv, self.group, self.pending = x, send, recv, group, pending
        self.out = x.new_empty((sum(recv), *x.shape[1:]))
        self.work = all_to_all_single(self.out, x.detach().contiguous(), recv, send, group=group, async_op=True)

    def result(self) -> torch.Tensor:
        with get_timers().span("ep.all_to_all", kind="comm", op="all_to_all", group="ep"):
            self.work.wait()
        return _Exchanged.apply(self.x, self.out, self.send, self.recv, self.group, self.pending)


def _awaiting(x: torch.Tensor) -> tuple[torch.Tensor, _Pending]:
    """`x` behind a backward wait for the exchange that will consume it."""
    pending = _Pending()
    return _AwaitGrad.apply(x, pending), pending


def expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Received rows come as blocks (source rank s, local expert j), source-major, `recv[s, j]`
    rows each; the indices that put them local-expert-major (each expert's rows together)."""
    sizes = recv.t().reshape(-1)  # blocks in (j, s) order
    starts = (recv.reshape(-1).cumsum(0) - recv.reshape(-1)).view_as(recv).t().reshape(-1)
    block_of_row = torch.repeat_interleave(torch.arange(sizes.numel(), device=recv.device), sizes)
    first_row = (sizes.cumsum(0) - sizes)[block_of_row]
    return starts[block_of_row] + torch.arange(block_of_row.numel(), device=recv.device) - first_row


def chunk_rows(counts: torch.Tensor, chunks: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Cut rows sorted by expert (`counts[e]` each) into `chunks` parts, each again sorted by
    expert: part c takes the c-th share of every expert's rows. Returns each part's row indices
    and the parts' counts `[chunks, E]`."""
    starts = counts.cumsum(0) - counts
    bounds = torch.stack([counts * c // chunks for c in range(chunks + 1)])  # [chunks+1, E]
    sizes = bounds[1:] - bounds[:-1]
    parts = []
    for c in range(chunks):
        first = torch.repeat_interleave(starts + bounds[c], sizes[c])
        offset = torch.arange(first.numel(), device=counts.device) - torch.repeat_interleave(
            sizes[c].cumsum(0) - sizes[c], sizes[c]
        )
        parts.append(first + offset)
    return parts, sizes


class ExpertParallelDispatch:
    """`MoE.dispatcher` of an ep rank: rows out to the experts' ranks, results back.

    With `chunks` > 1 (parallel.ep_overlap_chunks) the rows are cut into parts, each sorted by
    expert, and pipelined: part c+1's dispatch and part c-1's combine are in flight while part
    c's experts compute, in forward and (reversed) in backward."""

    def __init__(self, group: dist.ProcessGroup, ep: int, chunks: int = 1) -> None:
        self.group, self.ep, self.chunks = group, ep, chunks

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[parts, E] rows this rank sends to each expert -> [parts, ep, E/ep] rows each source
        sends to each of this rank's experts, for every part, in one small all-to-all."""
        parts = counts.shape[0]
        send = counts.view(parts, self.ep, -1).transpose(0, 1).contiguous()  # by destination rank
        recv = torch.empty_like(send)
        with get_timers().span("ep.all_to_all.counts", kind="comm", op="all_to_all", group="ep"):
            all_to_all_single(recv, send, group=self.group)
        return recv.transpose(0, 1)  # [parts, source rank, local expert]

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: ExpertsFn) -> torch.Tensor:
        chunks = self.chunks  # alike on every ep rank (their row counts differ)
        rows, sizes = chunk_rows(counts, chunks) if chunks > 1 else ([None], counts.view(1, -1))
        recv = self.exchange_counts(sizes)
        send_rows = sizes.view(chunks, self.ep, -1).sum(2).tolist()
        recv_rows = recv.sum(2).tolist()

        # every part's backward wait for its dispatch's gradient first: autograd runs them last
        parts = [_awaiting(x if rows[c] is None else x[rows[c]]) for c in range(chunks)]

        def dispatch(c: int) -> _InFlight:
            part, pending = parts[c]
            return _InFlight(part, send_rows[c], recv_rows[c], self.group, pending)

        dispatches, combines = [dispatch(0)], []
        for c in range(chunks):
            if c + 1 < chunks:
                dispatches.append(dispatch(c + 1))  # in flight while part c computes
            received = dispatches[c].result()
            order = expert_major(recv[c])
            y = experts(received[order], recv[c].sum(0).tolist())
            back = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
            y, pending = _awaiting(y[back])  # waited for in backward before this part's experts
            combines.append(_InFlight(y, recv_rows[c], send_rows[c], self.group, pending))
        outs = [combine.result() for combine in combines]
        if chunks == 1:
            return outs[0]
        where = torch.cat(rows)  # part rows back to the order of x
        return torch.empty_like(x).index_copy(0, where, torch.cat(outs))


def check_expert_layout(model: nn.Module, ep: int) -> None:
    """Every MoE layer splits into ep equal sets of whole experts (checked before any collective)."""
    for layer in moe_layers(model):
        if layer.num_experts % ep:
            raise ConfigError(f"parallel.ep={ep} must divide model.moe.experts={layer.num_experts}")


def apply_expert_parallel(model: nn.Module, mesh, chunks: int = 1) -> None:
    """Keep this rank's experts of every MoE layer and route through the ep group (`chunks`:
    parts of a micro-batch's rows pipelined against the experts)."""
    ep, rank = mesh.ep_size, mesh.ep_rank
    check_expert_layout(model, ep)
    for layer in moe_layers(model):
        per_rank = layer.num_experts // ep
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        for key in list(layer.experts.keys()):
            if int(key) not in mine:
                del layer.experts[key]
        layer.dispatcher = ExpertParallelDispatch(mesh.ep_group, ep, chunks)
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


def sequence_groups(mesh, sequence_parallel: bool) -> list[tuple[str, dist.ProcessGroup]]:
    """The groups over which one sequence's tokens are split: cp (each cp rank holds a part of
    every sequence) and tp under sequence parallelism (each tp rank a slice of that part)."""
    if mesh is None:
        return []
    groups = [("cp", mesh.cp_group)] + ([("tp", mesh.tp_group)] if sequence_parallel else [])
    return [(dim, group) for dim, group in groups if group is not None]


def summed_over(groups: list[tuple[str, dist.ProcessGroup]], device: torch.device):
    """A function summing a small statistic over each of `groups` in turn (a timed comm span
    each: these run inside `forward` and at the step's end, where a wait is not work)."""

    def reduce(stats: torch.Tensor) -> torch.Tensor:
        if groups:
            stats = stats.detach().to(device, copy=True)
            for dim, group in groups:
                timed_all_reduce(stats, group, dim=dim)
        return stats

    return reduce


def apply_sequence_sums(model: nn.Module, mesh, sequence_parallel: bool) -> None:
    """Each MoE layer's per-sequence statistics (its balancing loss's expert counts) summed over
    the ranks holding parts of the sequence, so they are the whole sequence's, as on one process."""
    groups = sequence_groups(mesh, sequence_parallel)
    if groups:
        for layer in moe_layers(model):
            layer.sequence_sum = summed_over(groups, mesh.device)


def balance_reducer(mesh, sequence_parallel: bool):
    """Sum of the routing statistics over every rank that routes its own tokens: dp, and the
    ranks holding parts of each sequence (cp; tp under sequence parallelism; without it the tp
    ranks route the same tokens)."""
    if mesh is None:
        return summed_over([], torch.device("cpu"))
    data = [("dp", mesh.dp_group)] if mesh.dp_group is not None else []
    return summed_over(data + sequence_groups(mesh, sequence_parallel), mesh.device)


__all__ = [
    "ExpertGradSync",
    "ExpertParallelDispatch",
    "MoE",
    "apply_expert_parallel",
    "apply_sequence_sums",
    "balance_reducer",
    "chunk_rows",
    "expert_major",
]
