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

from megascale.config.schema import JobConfig
from megascale.model.flops import norm_parameters, parameter_count
from megascale.plan.cluster import GPUSpec
from megascale.plan.layout import Layout, Workload

MASTER_STATE_BYTES = 12  # mixed precision: fp32 master weight + two fp32 moments (AdamW, LAMB)
FP32_STATE_BYTES = 8  # fp32 training: two fp32 moments (the parameter itself is the master)
GRAD_BYTES = 4  # gradients accumulate in fp32 across micro-batches


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
    return param_split(work).stage(work.model.layers, layout.pp) / layout.tp


def activation_elements_per_token(work: Workload, recompute: str) -> float:
    """Elements one layer saves for backward per token (before tp/sp splitting)."""
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


def in_flight_micro_batches(layout: Layout, micro_batches: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak (1F1B, interleaved)."""
    p, v = layout.pp, layout.v
    held = float(min(micro_batches, p))
    if v > 1:
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


def memory_per_gpu(work: Workload, layout: Layout, gpu: GPUSpec, attention: str = "flash2") -> MemoryEstimate:
    m = work.model
    t, dp = layout.tp, layout.dp
    psi = stage_params_per_gpu(work, layout)
    layer_psi = param_split(work).layer / t
    ab = work.act_bytes
    param_bytes = ab if work.mixed_precision else 4
    state_bytes = MASTER_STATE_BYTES if work.mixed_precision else FP32_STATE_BYTES

    params = param_bytes * psi / (dp if layout.zero >= 3 else 1)
    grads = GRAD_BYTES * psi / (dp if layout.zero >= 2 else 1)
    optimizer = state_bytes * psi / (dp if layout.zero >= 1 else 1)

    tokens = layout.micro_batch * m.seq_len // layout.cp  # under cp: this rank's part of each sequence
    per_layer = tokens * activation_elements_per_token(work, layout.recompute) * ab / t
    per_layer += tokens * m.heads * 4 / t  # fused attention's fp32 log-sum-exp per head
    if attention == "unfused" and layout.recompute == "none":  # the softmax output, s x s per head
        per_layer += layout.micro_batch * m.heads / t * m.seq_len * m.seq_len * ab
    stage_layers = m.layers // layout.pp
    micro = layout.micro_batches(work.global_batch)
    activations = per_layer * stage_layers * in_flight_micro_batches(layout, micro)
    if layout.recompute != "none":  # one layer's full set lives while it is recomputed
        activations += tokens * activation_elements_per_token(work, "none") * ab / t

    full_act = tokens * m.hidden * ab  # one gathered (b, s, h) activation
    buffers = 0.0
    if t > 1:
        buffers += 2 * full_act  # gathered GEMM input, double-buffered for the chunked overlap
    if dp > 1:
        buffers += layer_psi * (GRAD_BYTES + 2 * param_bytes)  # unsharded grad + 2 gathered layers
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
    # CPU attention with a sliding window is SDPA with a band mask: the scores are materialized
    attention = "unfused" if device != "cuda" and cfg.model.window is not None else "flash2"
    device_spec = GPUSpec(
        name=device,
        peak_flops={},
        memory_bytes=float("inf"),
        hbm_bytes_per_s=0.0,
        gemm_efficiency=1.0,
        attention_efficiency=1.0,
        reserved_bytes=0.0,
    )
    return memory_per_gpu(Workload.from_job(cfg), layout, device_spec, attention)
