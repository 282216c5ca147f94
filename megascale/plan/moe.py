"""The planner's model of mixture-of-experts layers: what an ep rank holds, what a token runs,
what the all-to-all moves. The rest of the planner models every MLP as dense; these functions
turn that into the MoE model the trainer runs (megascale.model.moe, megascale.parallel.expert).

- Memory: an MoE layer's routed experts are split over ep (each rank holds E/ep whole experts)
  and, like the router and the shared expert, are not sliced by tp (the trainer's "expert tensor
  parallel = 1"). ZeRO shards the dense parameters' state over dp and the experts' over their
  expert-data group (dp/ep ranks), so the sharded state per GPU is the same for every ep; what
  ep saves is the unsharded parameters (and gradient buffers) of the experts: total/ep.
- Compute: a token runs the router, its top_k experts and the shared expert (what
  megascale.model.flops counts for MFU), not every expert held. Under sequence parallelism (the
  planner's tp) each tp rank runs the MoE MLP on its tokens/tp slice, with no tp collective.
- Communication: per MoE layer and micro-batch four all-to-alls (dispatch and combine, forward
  and backward) of tokens/tp * top_k rows of `hidden` over the ep group (ep consecutive dp
  ranks, stride tp: the cluster's links as `comm.group_link` finds them), (ep-1)/ep of the rows
  leaving the rank. With the chunked overlap (parallel.ep_overlap_chunks) each is pipelined
  against the experts' GEMMs of its direction (`comm.chunked_overlap_exposed`).

- Data parallelism: the routed experts' ZeRO traffic (gathered parameters, reduce-scattered
  gradients) runs over their expert-data group, dp/ep ranks `tp * ep` apart, with E/ep experts'
  worth of bytes (`expert_dp_times`); the dense parameters' over dp as before. So ep cuts the
  experts' data-parallel bytes by ep, and adds the all-to-alls.

Not modelled: router imbalance (a balanced router is assumed; the step waits for the busiest
ep rank), the MoE layer's activations (counted as a dense MLP's), and under tensor parallelism
the sum over tp of the (unsliced) MoE parameters' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megascale.config.schema import ModelConfig, MoEConfig
from megascale.model.flops import mlp_parameters, parameter_count
from megascale.plan import comm
from megascale.plan import efficiency as eff
from megascale.plan.cluster import ClusterSpec
from megascale.plan.layout import Features, Layout, Workload


@dataclass(frozen=True)
class StageParams:
    """Parameters per GPU of the largest pipeline stage."""

    dense: float  # replicated over dp: ZeRO shards their state over dp
    experts: float  # this rank's routed experts: replicated over dp/ep, ZeRO-sharded over those

    @property
    def total(self) -> float:
        return self.dense + self.experts

    def sharded(self, dp: int, ep: int) -> float:
        """What ZeRO leaves on one GPU."""
        return self.dense / dp + self.experts / (dp // ep)


def moe_layers_in_stage(m: ModelConfig, pp: int) -> int:
    """MoE layers of the pipeline stage that has the most (stages of layers/pp consecutive blocks)."""
    if not m.moe.experts:
        return 0
    per = m.layers // pp
    return max(sum(m.moe.is_moe_layer(i) for i in range(s * per, (s + 1) * per)) for s in range(pp))


def stage_params(work: Workload, layout: Layout, dense_stage: float) -> StageParams:
    """`dense_stage`: the stage's parameters per GPU were every MLP dense (divided by tp)."""
    m = work.model
    n = moe_layers_in_stage(m, layout.pp)
    if not n:
        return StageParams(dense=dense_stage, experts=0.0)
    routed = m.moe.experts * mlp_parameters(m, m.expert_ffn)
    one = replace(m, layers=1, moe=replace(m.moe, every=1))
    moe_mlp = parameter_count(one) - parameter_count(replace(one, moe=MoEConfig()))  # vs the dense MLP
    replicated = moe_mlp - routed + mlp_parameters(m, m.ffn)  # router, shared expert (+ gate, bias)
    dense = dense_stage + n * (replicated - mlp_parameters(m, m.ffn) / layout.tp)
    return StageParams(dense=dense, experts=n * routed / layout.ep)


@dataclass(frozen=True)
class MoETimes:
    """What MoE layers change in one micro-batch through the slowest stage (seconds)."""

    fwd: float  # MoE MLPs' compute minus that of the dense MLPs they replace
    bwd: float
    tp_total: float  # the replaced dense MLPs' tp collectives (negative: MoE MLPs issue none)
    tp_exposed: float
    ep_total: float  # all-to-alls issued
    ep_exposed: float
    detail: dict[str, float]


def moe_times(
    work: Workload, layout: Layout, cluster: ClusterSpec, features: Features, dense_mlp_tp: tuple[float, float]
) -> MoETimes | None:
    """`dense_mlp_tp`: (issued, exposed) tp seconds of one dense MLP's collectives per micro-batch,
    forward and backward, as the dense model counts them (0 when fused with attention's)."""
    m, gpu = work.model, cluster.gpu
    n = moe_layers_in_stage(m, layout.pp)
    if not n:
        return None
    e, t, ab, dt = m.moe, layout.tp, work.act_bytes, work.dtype
    tokens = layout.micro_batch * m.seq_len // layout.cp  # under cp: this rank's part of each sequence
    h = m.hidden
    mine = tokens / t  # rows this rank routes (sequence parallel)

    def mlp(rows: float, width: int) -> float:  # a SwiGLU / GeLU MLP's two GEMMs
        up = 2 * width if m.mlp == "swiglu" else width
        return eff.gemm_time(gpu, dt, rows, up, h, ab) + eff.gemm_time(gpu, dt, rows, h, width, ab)

    local = e.experts // layout.ep
    rows_per_expert = mine * e.top_k * layout.ep / e.experts  # balanced: every rank's share of its experts
    experts = local * mlp(rows_per_expert, m.expert_ffn)
    moe_fwd = eff.gemm_time(gpu, dt, mine, e.experts, h, ab) + experts
    if e.shared_ffn_hidden:
        moe_fwd += mlp(mine, e.shared_ffn_hidden)
    dense_fwd = eff.gemm_time(gpu, dt, tokens, m.mlp_in_width / t, h, ab) + eff.gemm_time(
        gpu, dt, tokens, h, m.ffn / t, ab
    )

    ep_total = ep_exposed = a2a = 0.0
    if layout.ep > 1:
        link = comm.group_link(cluster, layout.ep, t * layout.cp)  # ep ranks are dp ranks: tp * cp apart
        a2a = comm.all_to_all_time(layout.ep, mine * e.top_k * h * ab, link)
        ep_total = 4 * a2a
        if features.ep_overlap and features.ep_chunks > 1:
            k = features.ep_chunks
            ep_exposed = 2 * comm.chunked_overlap_exposed(a2a, experts, experts / k, k)
            ep_exposed += 2 * comm.chunked_overlap_exposed(a2a, 2 * experts, 2 * experts / k, k)
        else:
            ep_exposed = ep_total
    tp_total, tp_exposed = dense_mlp_tp
    return MoETimes(
        fwd=n * (moe_fwd - dense_fwd),
        bwd=n * 2 * (moe_fwd - dense_fwd),
        tp_total=-n * tp_total,
        tp_exposed=-n * tp_exposed,
        ep_total=n * ep_total,
        ep_exposed=n * ep_exposed,
        detail={"moe_layers_per_stage": n, "moe_mlp_fwd": moe_fwd, "ep_all_to_all": a2a},
    )


@dataclass(frozen=True)
class ExpertDP:
    """Per step, the routed experts' data-parallel collectives (seconds)."""

    all_gather: float  # ZeRO: updated parameter shards gathered
    reduce_scatter: float  # ZeRO: gradients reduce-scattered
    all_reduce: float  # DDP (zero = 0): gradients all-reduced


def expert_dp_times(
    work: Workload, layout: Layout, cluster: ClusterSpec, slowdown: float, nbytes: int, grad_bytes: int
) -> ExpertDP:
    """The experts of the stage with the most MoE layers, one FSDP unit per MoE layer, over the
    expert-data group (`slowdown`: the dp group's congestion, taken for this group too)."""
    n, group = moe_layers_in_stage(work.model, layout.pp), layout.dp // layout.ep
    if not n or group == 1:
        return ExpertDP(0.0, 0.0, 0.0)
    m = work.model
    unit = m.moe.experts // layout.ep * mlp_parameters(m, m.expert_ffn)
    link = comm.group_link(cluster, group, layout.tp * layout.cp * layout.ep, slowdown)
    return ExpertDP(
        all_gather=n * comm.all_gather_time(group, unit * nbytes, link),
        reduce_scatter=n * comm.reduce_scatter_time(group, unit * grad_bytes, link),
        all_reduce=n * comm.all_reduce_time(group, unit * grad_bytes, link),
    )


def ep_choices(work: Workload, dp: int, only: tuple[int, ...] | None = None) -> list[int]:
    """Expert-parallel degrees a layout of `dp` can take: divisors of dp and of the expert count."""
    experts = work.model.moe.experts
    if not experts:
        return [1]
    return [d for d in range(1, dp + 1) if dp % d == 0 and experts % d == 0 and (only is None or d in only)]
