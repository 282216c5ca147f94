"""Memory per GPU of a layout: parameters, gradients, optimizer state, activations, buffers.

The accounting follows Rajbhandari et al. (ZeRO, 2020) for model state and Korthikanti et al.
("Reducing Activation Recomputation in Large Transformer Models", 2022) for activations, adapted
to this project's model: fused attention (no s x s score matrix is stored), no dropout, the
parallel block's single LayerNorm, tensor + sequence parallelism splitting every saved tensor
over tp. The stage that holds the most is the one that must fit: the first pipeline stage keeps
the most micro-batches in flight, the last holds the vocabulary head and the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megascale.config.fields import ConfigError
from megascale.config.schema import JobConfig, MoEConfig, ParallelConfig
from megascale.model.flops import norm_parameters, parameter_count
from megascale.plan.cluster import GPUSpec
from megascale.plan.layout import Layout, Workload
from megascale.plan.moe import StageParams, stage_params

MASTER_STATE_BYTES = 12  # mixed precision: fp32 master weight + two fp32 moments (AdamW, LAMB)
FP32_STATE_BYTES = 8  # fp32 training: two fp32 moments (the parameter itself is the master)
GRAD_BYTES = 4  # ZeRO's gradient shards are fp32
DEFAULT_BUCKET_MB = ParallelConfig().dp_bucket_mb
ZERO_IN_FLIGHT = 2  # buckets whose buffers exist at once: parallel.zero.IN_FLIGHT (plan may not import it)


@dataclass(frozen=True)
class ParamSplit:
    """Parameter counts of one transformer layer and of what sits outside the layers."""

    layer: int
    embedding: int  # token (+ learned position) embeddings: first pipeline stage
    head: int  # final norm + untied vocabulary head: last pipeline stage

    def stage(self, layers: int, pp: int) -> int:
        """Parameters of the largest stage (layers / pp layers plus its ends)."""
        ends = self.embedding + self.head if pp == 1 else max(self.embedding, self.head)
        return layers // pp * self.layer + ends


def param_split(work: Workload) -> ParamSplit:
    m = work.model
    no_layers = parameter_count(replace(m, layers=0))
    layer = parameter_count(replace(m, layers=1)) - no_layers
    untied_head = parameter_count(replace(m, layers=0, tie_embeddings=False)) - parameter_count(
        replace(m, layers=0, tie_embeddings=True)
    )
    head = (0 if m.tie_embeddings else untied_head) + norm_parameters(m)  # + final norm
    return ParamSplit(layer=layer, embedding=no_layers - head, head=head)


def stage_params_per_gpu(work: Workload, layout: Layout) -> float:
    return stage_parameters(work, layout).total


def stage_parameters(work: Workload, layout: Layout) -> StageParams:
    """The largest stage's parameters per GPU, an MoE model's routed experts apart (plan.moe)."""
    dense = replace(work, model=replace(work.model, moe=MoEConfig())) if work.model.moe.experts else work
    split = param_split(dense)
    if layout.schedule == "zbv" and layout.pp > 1:  # the V: rank 0 holds the embedding and the head
        stage = work.model.layers // layout.pp * split.layer + split.embedding + split.head
    else:
        stage = split.stage(work.model.layers, layout.pp)
    return stage_params(work, layout, stage / layout.tp)


def activation_elements_per_token(work: Workload, recompute: str) -> float:
    """Korthikanti et al. 2022's count, for the published systems (Megatron's sequence
    parallelism re-gathers the GEMM inputs in backward): elements one layer saves for backward
    per token, before tp/sp splitting."""
    m = work.model
    h, f = m.hidden, m.ffn
    norms = m.parallel_norms if m.block == "parallel" else 2
    if recompute == "full":
        return h  # the layer input only
    # per norm: its input and output; attention: q, k, v (narrower under GQA), o; MLP: the
    # activation's input (SwiGLU: gate and up) and fc2 input
    saved = norms * 2 * h + m.qkv_width + h + m.mlp_in_width + f
    if recompute == "selective":
        saved -= norms * h + f  # LayerNorm outputs and GeLU outputs are recomputed
    return saved


def activation_bytes_per_token(work: Workload, recompute: str = "none", tp: int = 1) -> float:
    """Bytes one layer saves for backward per token on one of `tp` ranks (sequence parallel),
    as the model code saves them (checked against fake mode, `testing/fake_memory.py`):

    - each norm's input, a sequence shard (RMSNorm keeps it and the normalised value in fp32),
      and its statistics per token;
    - each distinct column-parallel GEMM input (the norm outputs: one in the parallel block with
      one norm), saved *whole* -- the sequence all-gathered -- not re-gathered in backward;
    - the QKV output; with rotary positions the rotated q and k as well (else, with grouped
      queries, q cut out as a copy); the attention kernel's
      output (its backward reads it), copied once more as the output projection's input when
      the block's GEMMs are fused or the window kernel's layout is not the projection's; the
      kernel's fp32 log-sum-exp per head;
    - the MLP's input-projection output and the fc2 input (SwiGLU also keeps silu(gate)).

    Selective recomputation reruns the attention core: the rotated q/k, its output copy and the
    log-sum-exp are not kept. Full keeps the layer input only."""
    m = work.model
    ab, h, t = work.act_bytes, m.hidden, tp
    if recompute == "full":
        return h / t * ab
    norms = m.parallel_norms if m.block == "parallel" else 2
    # RMSNorm keeps x and x * rsqrt(mean(x^2)) in fp32, and the fp32 rsqrt per token; LayerNorm
    # its input, and the mean and 1/std per token
    norm_in = (h * 8 + 4) / t if m.norm == "rmsnorm" else (h + 2) * ab / t
    gemm_inputs = 1 if m.block == "parallel" and norms == 1 else 2
    fused = m.block == "parallel" and norms == 1 and t > 1  # tensor parallelism fuses them
    q_width, k_width = m.heads * m.head_dim, m.kv_groups * m.head_dim
    saved = norms * norm_in + gemm_inputs * h * ab + m.qkv_width / t * ab
    attention_copies = 1 + (fused or m.window is not None)
    if recompute == "selective":
        attention_copies = 1
    else:
        saved += m.heads / t * 4  # log-sum-exp
        if m.positions == "rotary":
            saved += (q_width + k_width) / t * ab
        elif m.kv_groups != m.heads:  # grouped queries: q is cut out of the QKV output as a copy
            saved += q_width / t * ab
    saved += attention_copies * q_width / t * ab
    saved += (m.mlp_in_width + m.ffn * (2 if m.mlp == "swiglu" else 1)) / t * ab
    return saved


def micro_batch_extra_bytes(work: Workload, tp: int = 1, head: bool = True) -> float:
    """Per sequence of a micro-batch, outside the layers: the token ids (int64) and the
    embedding's mask (vocabulary-parallel), rotary's cos/sin tables, and with the `head` (one
    pipeline stage) its norm's input and statistics and the normed input of the vocabulary
    projection, the whole sequence on every tp rank."""
    m, ab = work.model, work.act_bytes
    per_token = 8.0 + 1 + (2 * m.rotary_dim * ab if m.positions == "rotary" else 0)
    if head:
        norm_in = (m.hidden * 8 + 4) / tp if m.norm == "rmsnorm" else (m.hidden + 2) * ab / tp
        per_token += norm_in + m.hidden * ab
    return m.seq_len * per_token


def in_flight_micro_batches(layout: Layout, micro_batches: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak. 1F1B: p;
    interleaved: more. ZB-H1 and ZB-V hold 1F1B's p on every rank (ZB-V: 2p chunk-activations
    of half a stage), counting a micro-batch between its B and W (each GEMM's input and output
    gradient) as a whole one; the runtime measures 1.10x / 1.12x 1F1B's peak at p = 2
    (tests/parallel/test_pipeline_memory.py)."""
    p, v = layout.pp, layout.v
    held = float(min(micro_batches, p))
    if v > 1 and layout.schedule == "1f1b":
        held *= 1 + (p - 1) / (p * v)
    return held


@dataclass(frozen=True)
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    reserved: float
    capacity: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.reserved

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "reserved": self.reserved,
            "total": self.total,
            "capacity": self.capacity,
        }


def gradient_buffer_bytes(
    psi: float, dp: int, param_bytes: int, bucket_mb: float = DEFAULT_BUCKET_MB, largest: float = 0.0
) -> float:
    """Every parameter's autograd gradient (in its dtype), accumulated over the micro-batches
    until its ZeRO bucket is reduce-scattered, and ZeRO's communication buffers: at most
    `ZERO_IN_FLIGHT` buckets, unsharded (`dp x` the per-rank region), in fp32 (the reduce dtype)
    or the parameters' dtype, whichever is wider. A parameter larger than a bucket (`largest`
    elements on this rank before dp) is a bucket of its own."""
    buffers = psi * param_bytes
    if dp > 1:
        region = max(bucket_mb * 2**20 / 4, largest / dp)  # fp32 elements per rank of a bucket
        buffers += dp * min(ZERO_IN_FLIGHT * region, psi / dp) * max(4, param_bytes)
    return buffers


def largest_parameter(work: Workload, tp: int) -> float:
    """Elements of the largest parameter's tp slice: the vocabulary matrix or the MLP's input."""
    m = work.model
    vocab = m.vocab_size * m.hidden / (tp if m.vocab_size % tp == 0 else 1)
    return max(vocab, m.hidden * m.mlp_in_width / tp, m.hidden * m.qkv_width / tp)


def memory_per_gpu(
    work: Workload,
    layout: Layout,
    gpu: GPUSpec,
    attention: str = "flash2",
    bucket_mb: float = DEFAULT_BUCKET_MB,
    as_built: bool = False,
) -> MemoryEstimate:
    """`as_built`: megascale's own code, as fake mode measures it (`activation_bytes_per_token`,
    `gradient_buffer_bytes`; `bucket_mb` is its `parallel.dp_bucket_mb`); otherwise the
    published systems' accounting (Korthikanti et al. 2022) the search is validated on."""
    m = work.model
    t, dp = layout.tp, layout.dp
    stage = stage_parameters(work, layout)
    psi, shard = stage.total, stage.sharded(dp, layout.ep)
    ab = work.act_bytes
    param_bytes = ab if work.mixed_precision else 4
    state_bytes = MASTER_STATE_BYTES if work.mixed_precision else FP32_STATE_BYTES

    params = param_bytes * (shard if layout.zero >= 3 else psi)
    grads = GRAD_BYTES * (shard if layout.zero >= 2 else psi)
    optimizer = state_bytes * (shard if layout.zero >= 1 else psi)

    tokens = layout.micro_batch * m.seq_len // layout.cp  # under cp: this rank's part of each sequence
    stage_layers = m.layers // layout.pp
    micro = layout.micro_batches(work.global_batch)
    if as_built:
        per_layer = tokens * activation_bytes_per_token(work, layout.recompute, t)
        extra = layout.micro_batch * micro_batch_extra_bytes(work, t, layout.pp == 1) / layout.cp
        live = tokens * activation_bytes_per_token(work, "none", t)  # a layer being recomputed
    else:
        per_layer = tokens * activation_elements_per_token(work, layout.recompute) * ab / t
        per_layer += tokens * m.heads * 4 / t  # fused attention's fp32 log-sum-exp per head
        extra, live = 0.0, tokens * activation_elements_per_token(work, "none") * ab / t
    if attention == "unfused" and layout.recompute == "none":  # the softmax output, s x s per head
        per_layer += layout.micro_batch * m.heads / t * m.seq_len * m.seq_len * ab
    activations = (per_layer * stage_layers + extra) * in_flight_micro_batches(layout, micro)
    if layout.recompute != "none":  # one layer's full set lives while it is recomputed
        activations += live

    full_act = tokens * m.hidden * ab  # one gathered (b, s, h) activation
    if as_built:
        buffers = gradient_buffer_bytes(psi, dp, param_bytes, bucket_mb, largest_parameter(work, t))
    else:  # an unsharded layer gradient and two gathered layers (ZeRO)
        buffers = param_split(work).layer / t * (GRAD_BYTES + 2 * param_bytes) if dp > 1 else 0.0
    if t > 1:
        buffers += 2 * full_act  # gathered GEMM input, double-buffered for the chunked overlap
    if layout.pp > 1:
        buffers += 4 * full_act / t  # send and receive buffers, both directions
    buffers += tokens * m.vocab_size / t * (ab + 4)  # logits and their fp32 softmax/gradient
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        buffers=buffers,
        reserved=gpu.reserved_bytes,
        capacity=gpu.memory_bytes,
    )


def job_memory_estimate(cfg: JobConfig, device: str) -> MemoryEstimate:
    """The estimate for one rank of a job as configured, with nothing reserved for the device
    context: what the trainer prints beside the memory it measures after its first step."""
    layout = Layout.from_job(cfg)
    device_spec = GPUSpec(
        name=device,
        peak_flops={},
        memory_bytes=float("inf"),
        hbm_bytes_per_s=0.0,
        gemm_efficiency=1.0,
        attention_efficiency=1.0,
        reserved_bytes=0.0,
    )
    # every attention kernel megascale runs, the CPU sliding window's included, keeps no scores
    work = Workload.from_job(cfg)
    return memory_per_gpu(work, layout, device_spec, "flash2", cfg.parallel.dp_bucket_mb, as_built=True)


def check_memory_limit(cfg: JobConfig, device: str) -> None:
    """Refuse, before a byte is allocated, a job whose rank the estimate puts over
    `train.memory_limit_gib`, naming what would fit: more cp (a rank keeps seq_len / cp of every
    activation), full recomputation, or a smaller micro-batch. The estimate is fake-mode-checked
    model state and saved activations; a kernel's transient workspace comes on top."""
    limit = cfg.train.memory_limit_gib * 2**30
    if not limit:
        return
    est = job_memory_estimate(cfg, device)
    if est.total <= limit:
        return
    parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in est.as_dict().items() if v and k not in ("total", "capacity"))
    fits = [f"{change}: {total / 2**20:.1f} MiB" for change, total in _alternatives(cfg, device) if total <= limit]
    fix = f"what fits: {'; '.join(fits)}" if fits else "no cp, recompute or micro-batch change fits"
    raise ConfigError(
        f"train.memory_limit_gib={cfg.train.memory_limit_gib:g} ({limit / 2**20:.1f} MiB): a rank of this layout "
        f"would hold {est.total / 2**20:.1f} MiB ({parts} MiB); {fix}; or raise train.memory_limit_gib"
    )


def _alternatives(cfg: JobConfig, device: str) -> list[tuple[str, float]]:
    """Valid one-key changes of the layout that cut a rank's memory, each with its estimate."""
    p, t = cfg.parallel, cfg.train
    changes = [
        (f"parallel.cp={p.cp * k} ({k}x the ranks)", replace(cfg, parallel=replace(p, cp=p.cp * k))) for k in (2, 4, 8)
    ]
    if t.recompute != "full":
        changes.append(("train.recompute='full'", replace(cfg, train=replace(t, recompute="full"))))
    if t.micro_batch > 1:
        changes.append(("train.micro_batch=1", replace(cfg, train=replace(t, micro_batch=1))))
    out = []
    for change, alt in changes:
        try:
            alt.validate()
        except ConfigError:
            continue
        out.append((change, job_memory_estimate(alt, device).total))
    return out
