"""Achievable speed of the kernels a training step runs, as a fraction of the device's peak.

Peak FLOP/s is never reached. A GEMM reaches `gpu.gemm_efficiency` of peak when all of its
dimensions are large and falls off as the smallest one shrinks (fewer tiles per SM, less reuse);
below the roofline's ridge it is bound by HBM bandwidth instead. Fused attention reaches
`gpu.attention_efficiency` with head dimension 128 and long spans and less for short spans or
narrow heads. Element-wise work (LayerNorm, GeLU, residual adds, rotary) and the optimizer step
move bytes, not FLOPs, and are timed against HBM bandwidth. The curves and the source of every
constant are in docs/planning.md ("Achievable efficiency").
"""

from __future__ import annotations

from megascale.model.flops import attention_flops
from megascale.plan.cluster import GPUSpec

# Smallest GEMM dimension at which a GEMM reaches half of its best efficiency. With 64 a
# 2048-wide GEMM gets 97% of the best, a 512-wide one 89%, a 128-wide one 67%: the shape of
# cuBLAS bf16 sweeps in NVIDIA's "Matrix Multiplication Background" guide (A100, fig. 2-4).
GEMM_HALF_DIM = 64.0
# Attention span (keys per query) at which fused attention reaches half its best efficiency,
# and the head-dim penalty: FlashAttention-2's A100 sweeps (Dao 2023, fig. 4-7) show seq 512
# at ~70% of seq 8k throughput and head dim 64 at ~85-90% of head dim 128.
ATTN_HALF_SPAN = 192.0
ATTN_HALF_HEAD_DIM = 16.0
# FlashAttention's convention: backward costs 2.5x the forward FLOPs (it recomputes QK^T).
ATTN_BWD_FLOPS_RATIO = 2.5
# FlashAttention-1 runs at about half of FlashAttention-2's speed (Dao 2023, "FlashAttention-2":
# "around 2x faster than FlashAttention" on A100, forward + backward).
FLASH1_RELATIVE_SPEED = 0.5
# Attention with materialised scores (Megatron's fused scale-mask-softmax path): the s x s score
# matrix is written by QK^T, read and written by the softmax and read by PV in forward (4 passes
# of 2 bytes), and about twice that in backward; both batched GEMMs run over the full s x s
# (the causal half is masked, not skipped).
UNFUSED_SCORE_PASSES_FWD = 4
UNFUSED_SCORE_PASSES_BWD = 8

# Element-wise traffic per token per layer, forward, in vectors of width `hidden` (h) and of the
# MLP width (f), counting each read and write once, with biases fused into the GEMMs:
# LayerNorm in+out (2 per norm), rotary on q and k (4), two residual adds (6), GeLU in+out (2f).
ELEMENTWISE_H_SERIAL = 14
ELEMENTWISE_H_PARALLEL = 12  # one LayerNorm fewer
ELEMENTWISE_F = 2
ELEMENTWISE_BWD_RATIO = 2.0  # backward reads the saved input and the incoming gradient
# Kernels launched per layer (forward); backward launches about twice as many.
KERNELS_PER_LAYER_FWD = 14
# Unfused LayerNorm and GeLU (MegaScale 3.3: "composed of fine-grained kernels in previous
# implementations"): assumed to be about two kernels each where the fused path has one, each
# reading and writing the tensor, so twice the element-wise bytes and twice the kernels.
UNFUSED_ELEMENTWISE_FACTOR = 2

# Bytes the optimizer moves per parameter of its shard: read param/grad/m/v, write param/m/v
# (7 x 4 bytes); mixed precision adds the fp32 master read/write and the bf16 copy write; LAMB
# adds one more pass over the update and the parameter for the per-tensor norms.
OPT_BYTES_FP32 = 28
OPT_BYTES_MIXED_EXTRA = 10
OPT_BYTES_LAMB_EXTRA = 8


def gemm_efficiency(gpu: GPUSpec, m: float, n: float, k: float) -> float:
    d = min(m, n, k)
    return gpu.gemm_efficiency * d / (d + GEMM_HALF_DIM)


def gemm_time(gpu: GPUSpec, dtype: str, m: float, n: float, k: float, elem_bytes: int) -> float:
    """Seconds for an (m x k) @ (k x n) GEMM: compute-bound or HBM-bound, whichever is slower."""
    flops = 2.0 * m * n * k
    compute = flops / (gpu.peak(dtype) * gemm_efficiency(gpu, m, n, k))
    memory = elem_bytes * (m * k + k * n + m * n) / gpu.hbm_bytes_per_s
    return max(compute, memory) + gpu.kernel_overhead_s


def attention_efficiency(gpu: GPUSpec, span: float, head_dim: int) -> float:
    span_factor = span / (span + ATTN_HALF_SPAN)
    dim_factor = (head_dim / (head_dim + ATTN_HALF_HEAD_DIM)) / (128 / (128 + ATTN_HALF_HEAD_DIM))
    return gpu.attention_efficiency * span_factor * min(1.0, dim_factor)


def attention_time(gpu: GPUSpec, dtype: str, fwd_flops: float, span: float, head_dim: int) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention with `fwd_flops` forward FLOPs."""
    rate = gpu.peak(dtype) * attention_efficiency(gpu, span, head_dim)
    return fwd_flops / rate, ATTN_BWD_FLOPS_RATIO * fwd_flops / rate


def unfused_attention_time(
    gpu: GPUSpec, dtype: str, sequences: float, seq: int, heads: float, head_dim: int, elem_bytes: int
) -> tuple[float, float]:
    """(forward, backward) seconds of attention that materialises the s x s scores per head."""
    batch = sequences * heads  # independent (s x d) @ (d x s) and (s x s) @ (s x d) products
    rate = gpu.peak(dtype) * gemm_efficiency(gpu, seq, seq, head_dim)
    gemms = attention_flops(seq, heads * head_dim) * sequences * seq / rate  # the full square: s keys a query
    scores = batch * seq * seq * elem_bytes
    fwd = gemms + memory_time(gpu, UNFUSED_SCORE_PASSES_FWD * scores)
    bwd = 2 * gemms + memory_time(gpu, UNFUSED_SCORE_PASSES_BWD * scores)
    return fwd, bwd


def elementwise_bytes_per_token(hidden: int, ffn: int, block: str, elem_bytes: int) -> float:
    """Forward bytes per token per layer moved by the non-GEMM, non-attention kernels."""
    h_vectors = ELEMENTWISE_H_PARALLEL if block == "parallel" else ELEMENTWISE_H_SERIAL
    return (h_vectors * hidden + ELEMENTWISE_F * ffn) * elem_bytes


def memory_time(gpu: GPUSpec, nbytes: float) -> float:
    return nbytes / gpu.hbm_bytes_per_s


def optimizer_bytes_per_param(optimizer: str, mixed_precision: bool) -> int:
    extra = OPT_BYTES_MIXED_EXTRA if mixed_precision else 0
    extra += OPT_BYTES_LAMB_EXTRA if optimizer == "lamb" else 0
    return OPT_BYTES_FP32 + extra
