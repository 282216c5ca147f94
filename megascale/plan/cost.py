"""Time of one training step of a decoder-only model under a layout, term by term.

One micro-batch through one pipeline stage (all its v chunks) costs forward + backward compute,
recomputation, the tensor-parallel communication the chunked-GEMM overlap does not hide, the
gaps between kernel launches and a fixed cost per model-chunk run. The interleaved 1F1B schedule
runs m such micro-batches plus a bubble of (p-1)/v of one, i.e. a bubble of (p-1)/(v*m) of the
busy time (Narayanan et al. 2021). On top come the exposed pipeline sends, the exposed
data-parallel all-gather/reduce-scatter (ZeRO), an MoE model's exposed expert-parallel
all-to-alls (plan/moe.py, which also turns the dense MLPs into MoE ones), the compute lost to
communication it overlaps,
the wait for the slowest of N ranks, the optimizer step, the global gradient-norm all-reduce and
the host's per-step work. Every overlap can be switched off (`Features`) and is modelled so that
switching it on never makes the step slower; every second-order effect (`Effects`) is its own
term. Derivations: docs/planning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megascale.model.flops import attention_flops, mean_attention_span
from megascale.plan import comm, congestion
from megascale.plan import efficiency as eff
from megascale.plan.cluster import ClusterSpec
from megascale.plan.flops import CONVENTIONS, training_flops_per_token
from megascale.plan.layout import Features, Layout, Workload
from megascale.plan.memory import MemoryEstimate, memory_per_gpu, param_split, stage_parameters
from megascale.plan.moe import expert_dp_times, moe_times

TERMS = (
    "compute",
    "recompute",
    "tp_exposed",
    "launch_gaps",
    "interleave",
    "bubble",
    "pp_exposed",
    "dp_exposed",
    "cp_exposed",
    "ep_exposed",
    "contention",
    "stragglers",
    "optimizer",
    "other",
    "host",
)


@dataclass(frozen=True)
class MicroBatchTimes:
    """Seconds for one micro-batch through the slowest pipeline stage, on one GPU."""

    fwd: float
    bwd: float
    recompute: float
    tp_total: float  # TP collectives issued, if nothing overlapped
    tp_exposed: float
    launch: float  # idle gaps between the stage's kernels
    chunk: float  # fixed cost of running each of the v chunks forward and backward
    detail: dict[str, float] = field(default_factory=dict)
    ep_total: float = 0.0  # MoE all-to-alls issued, if nothing overlapped
    ep_exposed: float = 0.0

    @property
    def busy(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.tp_exposed + self.ep_exposed + self.launch + self.chunk


@dataclass(frozen=True)
class StepEstimate:
    layout: Layout
    features: Features
    micro_batches: int
    terms: dict[str, float]  # seconds per step, keys TERMS; "compute" includes "recompute"
    tokens_per_step: int
    flops_per_step: dict[str, float]  # model FLOPs per step in each convention (flops.py)
    peak_flops_total: float
    memory: MemoryEstimate
    totals: dict[str, float]  # communication issued (exposed or hidden), per step
    detail: dict[str, float]
    inputs: dict[str, str] = field(default_factory=dict)  # what each effect was computed from

    @property
    def step_time(self) -> float:
        return sum(v for k, v in self.terms.items() if k != "recompute")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def model_flops_per_step(self) -> float:
        return self.flops_per_step["causal"]

    @property
    def mfu(self) -> float:
        return self.mfu_in("causal")

    def mfu_in(self, convention: str) -> float:
        return self.flops_per_step[convention] / self.step_time / self.peak_flops_total

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def breakdown(self) -> dict[str, float]:
        """Step terms with recomputation apart from the useful compute."""
        return {**self.terms, "compute": self.terms["compute"] - self.terms["recompute"]}


def micro_batch_times(work: Workload, layout: Layout, cluster: ClusterSpec, features: Features) -> MicroBatchTimes:
    """Compute and TP communication of one micro-batch through the slowest stage."""
    m, gpu = work.model, cluster.gpu
    dt, ab, t = work.dtype, work.act_bytes, layout.tp
    tokens = layout.micro_batch * m.seq_len // layout.cp  # under cp: this rank's part of each sequence
    h, f = m.hidden, m.ffn

    # (column GEMM, row GEMM) pairs: each column GEMM follows a TP all-gather and each row GEMM
    # precedes a reduce-scatter. The parallel block fuses QKV with fc1 and out-proj with fc2.
    # Their widths: QKV is narrower with grouped-query attention, SwiGLU's input GEMM twice as wide.
    qkv, up = m.qkv_width, m.mlp_in_width
    if m.block == "parallel" and m.parallel_norms == 1:
        pairs = [((tokens, (qkv + up) / t, h), (tokens, h, (h + f) / t))]
    else:
        pairs = [((tokens, qkv / t, h), (tokens, h, h / t)), ((tokens, up / t, h), (tokens, h, f / t))]

    def gemm(shape: tuple[float, float, float], rows: float = 1.0) -> float:
        return eff.gemm_time(gpu, dt, shape[0] * rows, shape[1], shape[2], ab)

    gemm_fwd = sum(gemm(col) + gemm(row) for col, row in pairs)
    span = mean_attention_span(m.seq_len, m.window)
    if features.attention == "unfused":
        attn_fwd, attn_bwd = (
            x / layout.cp
            for x in eff.unfused_attention_time(gpu, dt, layout.micro_batch, m.seq_len, m.heads / t, m.head_dim, ab)
        )
    else:
        attn_fwd, attn_bwd = eff.attention_time(gpu, dt, attention_flops(span, h) * tokens / t, span, m.head_dim)
        if features.attention == "flash1":
            attn_fwd, attn_bwd = (x / eff.FLASH1_RELATIVE_SPEED for x in (attn_fwd, attn_bwd))
    unfused = 1 if features.fused_elementwise else eff.UNFUSED_ELEMENTWISE_FACTOR
    elem_bytes = unfused * tokens * eff.elementwise_bytes_per_token(h, f, m.block, ab) / t
    elem_fwd = eff.memory_time(gpu, elem_bytes)
    kernels = unfused * eff.KERNELS_PER_LAYER_FWD
    overhead = kernels * gpu.kernel_overhead_s
    layer_fwd = gemm_fwd + attn_fwd + elem_fwd + overhead
    layer_bwd = 2 * gemm_fwd + attn_bwd + eff.ELEMENTWISE_BWD_RATIO * (elem_fwd + overhead)

    # TP + sequence parallelism: per pair, an all-gather of the (b, s, h) input and a
    # reduce-scatter of the output; backward re-gathers the input for the weight gradient.
    link = comm.group_link(cluster, t, 1)
    coll = comm.all_gather_time(t, tokens * h * ab, link)
    tp_fwd_exposed = tp_bwd_exposed = pair_exposed = 0.0
    for col, row in pairs:
        if features.tp_overlap and t > 1:
            k = features.tp_chunks
            ag = comm.chunked_overlap_exposed(coll, gemm(col), gemm(col, 1 / k), k)
            rs = comm.chunked_overlap_exposed(coll, gemm(row), gemm(row, 1 / k), k)
        else:
            ag = rs = coll
        tp_fwd_exposed += ag + rs
        tp_bwd_exposed += 2 * ag + rs  # re-gather + grad reduce-scatter, grad all-gather
        pair_exposed = 3 * ag + 2 * rs
    tp_layer_total = 5 * len(pairs) * coll
    # an MoE MLP replaces the dense one (its own tp collectives, when not fused with attention's)
    moe = moe_times(work, layout, cluster, features, (5 * coll, pair_exposed) if len(pairs) == 2 else (0.0, 0.0))

    layers = m.layers // layout.pp
    # the last stage (the slowest) also runs the vocabulary head and the loss
    head_shape = (tokens, m.vocab_size / t, h)
    ce_time = eff.memory_time(gpu, 4 * tokens * m.vocab_size / t * 4)  # fp32 softmax passes
    head_fwd = gemm(head_shape) + ce_time
    head_bwd = 2 * gemm(head_shape) + ce_time
    head_tp = 2 * coll  # gather before the head, reduce-scatter of its input gradient

    passes = 1 + eff.ELEMENTWISE_BWD_RATIO
    if layout.recompute == "full":
        recompute = layers * (layer_fwd + tp_fwd_exposed)
        passes += 1
    elif layout.recompute == "selective":
        norms = 1 if m.block == "parallel" else 2
        recompute = layers * eff.memory_time(gpu, tokens * (norms * 2 * h + 2 * f) * ab / t)
    else:
        recompute = 0.0
    impl, effects = features.impl, features.effects
    gap = impl.launch_gap_us * 1e-6 if effects.launch_gaps else 0.0
    chunk = impl.chunk_overhead_us * 1e-6 if effects.interleave else 0.0
    return MicroBatchTimes(
        fwd=layers * layer_fwd + head_fwd + (moe.fwd if moe else 0.0),
        bwd=layers * layer_bwd + head_bwd + (moe.bwd if moe else 0.0),
        recompute=recompute,
        tp_total=layers * tp_layer_total + head_tp + (moe.tp_total if moe else 0.0),
        tp_exposed=layers * (tp_fwd_exposed + tp_bwd_exposed) + head_tp + (moe.tp_exposed if moe else 0.0),
        launch=layers * kernels * passes * gap,
        chunk=2 * layout.v * chunk,
        ep_total=moe.ep_total if moe else 0.0,
        ep_exposed=moe.ep_exposed if moe else 0.0,
        detail={
            **(moe.detail if moe else {}),
            "layer_fwd": layer_fwd,
            "layer_bwd": layer_bwd,
            "gemm_fwd": gemm_fwd,
            "attention_fwd": attn_fwd,
            "attention_bwd": attn_bwd,
            "elementwise_fwd": elem_fwd,
            "tp_collective": coll,
            "head_fwd": head_fwd,
            "layers_per_stage": layers,
            "kernels_per_layer": kernels,
        },
    )


def bubble_time(layout: Layout, mb: MicroBatchTimes) -> float:
    """Seconds a stage idles per step, in the schedule's steady-state terms (m >= p; ZB-V
    m >= 2p - 1). Interleaved 1F1B: (p-1)/v micro-batches of busy time. The zero-bubble
    schedules split the backward into B and W (the weight-gradient GEMMs, half of it; the
    recompute belongs to B): ZB-H1 idles (p-1)(F + B - W) = (p-1)(F + recompute), a third of
    1F1B's with F = B = W; ZB-V, its chunks half a stage, half of that ((p-1) chunk-forwards,
    as `schedule.simulate` plays it). Overheads (tp exposure, launch gaps) scale with them."""
    p, v = layout.pp, layout.v
    if layout.schedule == "1f1b":
        return (p - 1) / v * mb.busy
    core = mb.fwd + mb.bwd + mb.recompute
    forward_share = (mb.fwd + mb.recompute) / core if core > 0 else 1 / 3
    idle = (p - 1) * forward_share * mb.busy
    return idle / 2 if layout.schedule == "zbv" else idle


def estimate(work: Workload, layout: Layout, cluster: ClusterSpec, features: Features | None = None) -> StepEstimate:
    """Predict one optimizer step of `work` under `layout` on `cluster`."""
    features = features or Features()
    layout.check(work, cluster.gpus_per_node if layout.world > 1 else None)
    m, impl, effects = work.model, features.impl, features.effects
    micro = layout.micro_batches(work.global_batch)
    mb = micro_batch_times(work, layout, cluster, features)
    p, v = layout.pp, layout.v
    inputs: dict[str, str] = {}

    # Pipeline: each micro-batch crosses 2v stage boundaries per stage (forward and backward).
    pp_total = pp_exposed = 0.0
    if p > 1:
        traffic = congestion.pp_traffic(cluster, layout.dp, layout.tp * layout.cp, p)  # cp sits next to tp
        slowdown = traffic.slowdown if effects.collisions else 1.0
        link = comm.p2p_link(cluster, layout.tp * layout.cp * layout.dp, slowdown)
        hop = comm.p2p_time(layout.micro_batch * m.seq_len * m.hidden * work.act_bytes / layout.tp / layout.cp, link)
        pp_total = (micro + (p - 1) / v) * 2 * v * hop
        # decoupled sends: only the fill and drain hops are on the critical path
        pp_exposed = 2 * (p - 1) * hop if features.pp_overlap else pp_total
        inputs["collisions_pp"] = _traffic_text(traffic, slowdown)

    dp_total, dp_exposed, dp_detail = _data_parallel(work, layout, cluster, features, mb, micro, inputs)
    cp_total, cp_exposed, cp_detail = _context_parallel(work, layout, cluster, mb, micro)
    stage = stage_parameters(work, layout)
    shard = stage.sharded(layout.dp, layout.ep) if layout.zero >= 1 else stage.total
    opt_bytes = eff.optimizer_bytes_per_param(work.optimizer, work.mixed_precision)
    optimizer = eff.memory_time(cluster.gpu, shard * opt_bytes)
    world = layout.world
    other = 0.0
    if world > 1:  # global grad norm (and LAMB's norms batched with it)
        other = 2 * math.ceil(math.log2(world)) * cluster.network.hop_latency_s

    terms = {
        "compute": micro * (mb.fwd + mb.bwd + mb.recompute),
        "recompute": micro * mb.recompute,
        "tp_exposed": micro * mb.tp_exposed,
        "launch_gaps": micro * mb.launch,
        "interleave": micro * mb.chunk,
        "bubble": bubble_time(layout, mb),
        "pp_exposed": pp_exposed,
        "dp_exposed": dp_exposed,
        "cp_exposed": cp_exposed,
        "ep_exposed": micro * mb.ep_exposed,
    }
    hidden = micro * (mb.tp_total - mb.tp_exposed) + (pp_total - pp_exposed) + (dp_total - dp_exposed)
    hidden += cp_total - cp_exposed + micro * (mb.ep_total - mb.ep_exposed)
    terms["contention"] = impl.overlap_contention * hidden if effects.contention else 0.0
    busy = terms["compute"] + terms["tp_exposed"] + terms["ep_exposed"] + terms["launch_gaps"] + terms["interleave"]
    busy += terms["contention"]
    hosts = max(1, world // cluster.gpus_per_node)
    slow = cluster.slow_hosts
    slowest = impl.jitter.expected_max(world, hosts, slow) if effects.stragglers else 1.0
    terms["stragglers"] = (slowest - 1.0) * busy
    inputs["stragglers"] = (
        f"{impl.jitter.describe()}; slow hosts {slow.fraction:.2%} at "
        f"+{slow.slowdown:.0%}; E[max of {world} ranks on {hosts} hosts] = "
        f"{slowest:.4f}"
    )
    inputs["contention"] = f"{impl.overlap_contention:.3f} x {hidden:.4f} s of hidden communication"
    terms |= {"optimizer": optimizer, "other": other, "host": impl.host_overhead_s if effects.host else 0.0}

    tokens = work.tokens_per_step
    return StepEstimate(
        layout=layout,
        features=features,
        micro_batches=micro,
        terms=terms,
        tokens_per_step=tokens,
        flops_per_step={c: tokens * training_flops_per_token(m, c, layout.recompute) for c in CONVENTIONS},
        peak_flops_total=cluster.gpu.peak(work.dtype) * world,
        memory=memory_per_gpu(work, layout, cluster.gpu, features.attention),
        totals={"tp": micro * mb.tp_total, "pp": pp_total, "dp": dp_total, "cp": cp_total, "ep": micro * mb.ep_total},
        detail={
            **mb.detail,
            **dp_detail,
            **cp_detail,
            "fwd_mb": mb.fwd,
            "bwd_mb": mb.bwd,
            "busy_mb": mb.busy,
            "straggler_factor": slowest,
        },
        inputs=inputs,
    )


def _traffic_text(traffic: congestion.Traffic, slowdown: float) -> str:
    return (
        f"{traffic.flows_per_switch} flows out of each of {traffic.switches} ToR switches, "
        f"{traffic.uplinks} uplinks of {traffic.capacity} flows: slowdown {slowdown:.3f}x"
    )


def _data_parallel(
    work: Workload,
    layout: Layout,
    cluster: ClusterSpec,
    features: Features,
    mb: MicroBatchTimes,
    micro: int,
    inputs: dict[str, str],
) -> tuple[float, float, dict[str, float]]:
    """(issued, exposed, detail) seconds of ZeRO data-parallel communication per step.

    Units are transformer layers (FSDP wraps each block), plus the embedding/head unit.
    Overlapped, the all-gathers run ahead of the forward (the first one behind data loading)
    and each chunk's reduce-scatter starts when its last backward ends; what stays exposed is
    the first all-gather (without data-loading overlap), what the first micro-batch's forward
    cannot cover, and the reduce-scatter of the chunk whose backward ends the step.
    """
    n = layout.dp
    if n == 1:
        return 0.0, 0.0, {}
    split = param_split(work)
    t, v = layout.tp, layout.v
    traffic = congestion.dp_traffic(cluster, n, t * layout.cp, layout.pp)  # dp ranks are tp * cp apart
    slowdown = features.network_slowdown or (traffic.slowdown if features.effects.collisions else 1.0)
    inputs["collisions_dp"] = _traffic_text(traffic, slowdown)
    link = comm.group_link(cluster, n, t * layout.cp, slowdown)
    nbytes = work.act_bytes  # bf16 parameters on the wire (fp32 on CPU)
    grad_bytes = features.impl.grad_wire_bytes or nbytes
    layers = work.model.layers // layout.pp
    ends_params = (split.embedding + split.head if layout.pp == 1 else max(split.embedding, split.head)) / t
    layer_params = (stage_parameters(work, layout).dense - ends_params) / layers  # an MoE model's experts apart
    unit, grad_unit = layer_params * nbytes, layer_params * grad_bytes
    ends, grad_ends = ends_params * nbytes, ends_params * grad_bytes
    detail = {"dp_link_gbps": link.bytes_per_s / 1e9, "dp_scope_" + link.scope: 1.0}
    experts = expert_dp_times(work, layout, cluster, slowdown, nbytes, grad_bytes)  # over dp/ep ranks

    if layout.zero == 0:
        ar_unit = comm.all_reduce_time(n, grad_unit, link)
        total = layers * ar_unit + comm.all_reduce_time(n, grad_ends, link) + experts.all_reduce
        exposed = (ar_unit + max(0.0, total / v - mb.bwd / v)) if features.dp_overlap else total
        return total, min(total, exposed), {**detail, "dp_allreduce_layer": ar_unit}

    ag_unit = comm.all_gather_time(n, unit, link)
    rs_unit = comm.reduce_scatter_time(n, grad_unit, link)
    ag = layers * ag_unit + comm.all_gather_time(n, ends, link) + experts.all_gather
    rs = layers * rs_unit + comm.reduce_scatter_time(n, grad_ends, link) + experts.reduce_scatter
    detail |= {"dp_allgather_layer": ag_unit, "dp_reducescatter_layer": rs_unit}
    if layout.zero == 3:  # parameters re-gathered in forward and backward of every micro-batch
        total = micro * (2 * ag + rs)
        if not features.dp_overlap:
            return total, total, detail
        per_mb = max(ag_unit + rs_unit, 2 * ag + rs - (mb.fwd + mb.bwd))
        return total, min(total, micro * per_mb), detail
    total = ag + rs
    if not features.dp_overlap:
        return total, total, detail
    first = 0.0 if features.data_overlap else ag_unit
    exposed_ag = first + max(0.0, ag - ag_unit - mb.fwd)
    exposed_rs = rs_unit + max(0.0, rs / v - mb.bwd / v)
    return total, min(total, exposed_ag + exposed_rs), detail


def _context_parallel(
    work: Workload, layout: Layout, cluster: ClusterSpec, mb: MicroBatchTimes, micro: int
) -> tuple[float, float, dict[str, float]]:
    """(issued, exposed, detail) seconds of context parallelism's traffic per step.

    Per layer and micro-batch, between cp neighbours (`parallel/ring.py`, `parallel/context.py`):
    full causal attention sends cp - 1 key/value blocks (this rank's part of the sequence) around
    the ring in the forward, each hidden behind one block's attention (1/cp of it), and in the
    backward the blocks again with their gradient accumulators (fp32, cp of them); a window w
    sends one halo of w - 1 positions forward and its gradient back, hidden behind the attention
    of the local queries. Then, once per step, the gradients' all-reduce over cp (after ZeRO's
    reduce-scatter, on this rank's shard), exposed.
    """
    c, m = layout.cp, work.model
    if c == 1:
        return 0.0, 0.0, {}
    local = layout.micro_batch * m.seq_len // c
    kv_bytes = 2 * m.kv_groups * m.head_dim / layout.tp * work.act_bytes  # K and V of one position
    link = comm.p2p_link(cluster, layout.tp)
    attn_fwd, attn_bwd = mb.detail["attention_fwd"], mb.detail["attention_bwd"]
    if m.window is None or m.window >= m.seq_len:  # ring attention
        hop = comm.p2p_time(local * kv_bytes, link)
        grad_hop = comm.p2p_time(local * kv_bytes * 4 / work.act_bytes, link)
        layer_total = 2 * (c - 1) * hop + c * grad_hop
        layer_exposed = (c - 1) * (max(0.0, hop - attn_fwd / c) + max(0.0, hop + grad_hop - attn_bwd / c)) + grad_hop
    else:  # the halo
        halo = min(m.window - 1, local)
        hop = comm.p2p_time(layout.micro_batch * halo * kv_bytes, link)
        hidden_share = 1 - halo / local
        layer_total = 2 * hop
        layer_exposed = max(0.0, hop - hidden_share * attn_fwd) + max(0.0, hop - hidden_share * attn_bwd)
    layers = m.layers // layout.pp
    psi = param_split(work).stage(m.layers, layout.pp) / layout.tp
    shard = psi / layout.dp if layout.zero >= 2 else psi
    grads = comm.all_reduce_time(c, shard * work.act_bytes, comm.group_link(cluster, c, layout.tp))
    total = micro * layers * layer_total + grads
    exposed = micro * layers * layer_exposed + grads
    return total, exposed, {"cp_hop": hop, "cp_grad_allreduce": grads}
