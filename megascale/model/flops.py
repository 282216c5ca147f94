"""FLOPs and parameters of the GPT, counted from its config (what MFU and the planner divide by).

Model FLOPs count the work the model needs, not the work the system does: forward + backward
(3x the forward GEMMs), attention over the span each token really attends to (causal, and
capped at the window under SWA), and never activation recomputation. These counts live beside
the model so that a new layer option changes its count in the same place (a test keeps
`parameter_count` equal to the built model's).
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config.schema import ModelConfig


def full_attention_span(seq_len: int, window: int | None) -> int:
    """Keys per query when every query is counted as seeing the whole span (window or sequence)."""
    return seq_len if window is None else min(window, seq_len)


def mean_attention_span(seq_len: int, window: int | None) -> float:
    """Average number of keys a query attends to under causal (optionally windowed) attention."""
    w = full_attention_span(seq_len, window)
    # positions 1..w attend to i keys; positions w+1..s attend to w keys
    total = w * (w + 1) / 2 + (seq_len - w) * w
    return total / seq_len


def attention_flops(span: float, hidden: float) -> float:
    """Forward FLOPs of one layer's attention for one query over `span` keys: QK^T and scores x V,
    each `span * hidden` multiply-adds of 2 FLOPs (the one formula the model and planner use)."""
    return 2 * 2 * span * hidden


@dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per token, by term. Training FLOPs per token are 3x the total."""

    dense: float  # QKV, attention output, MLP GEMMs of all layers
    attention: float  # QK^T and attention x V over the real span
    head: float  # vocabulary projection

    @property
    def forward(self) -> float:
        return self.dense + self.attention + self.head

    @property
    def training(self) -> float:
        return 3.0 * self.forward


def mlp_matmuls(cfg: ModelConfig, width: int) -> int:
    """Multiply-adds per token of one MLP of hidden width `width` (SwiGLU: three matrices)."""
    return cfg.hidden * width * (3 if cfg.mlp == "swiglu" else 2)


def mlp_layer_matmuls(cfg: ModelConfig, index: int) -> int:
    """Multiply-adds per token of block `index`'s MLP. An MoE layer counts what one token really
    runs -- the router, its `top_k` experts and the shared expert -- not every expert it holds."""
    moe = cfg.moe
    if not moe.is_moe_layer(index):
        return mlp_matmuls(cfg, cfg.ffn)
    shared = mlp_matmuls(cfg, moe.shared_ffn_hidden) if moe.shared_ffn_hidden else 0
    shared += cfg.hidden if moe.shared_gate else 0
    return cfg.hidden * moe.experts + moe.top_k * mlp_matmuls(cfg, cfg.expert_ffn) + shared


def flops_per_token(cfg: ModelConfig) -> FlopsBreakdown:
    """GQA's smaller key/value projections and SwiGLU's third matrix count as what they are, and
    an MoE layer its active experts only."""
    h, layers = cfg.hidden, cfg.layers
    dense = 2 * sum(h * cfg.qkv_width + h * h + mlp_layer_matmuls(cfg, i) for i in range(layers))
    attention = layers * attention_flops(mean_attention_span(cfg.seq_len, cfg.window), h)
    head = 2 * h * cfg.vocab_size
    return FlopsBreakdown(dense=float(dense), attention=float(attention), head=float(head))


def norm_parameters(cfg: ModelConfig) -> int:
    """One norm's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
    return cfg.hidden * (1 if cfg.norm == "rmsnorm" else 2)


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the GPT in `megascale.model` (kept in step with it by a test)."""
    h, v = cfg.hidden, cfg.vocab_size
    b = 1 if cfg.bias else 0
    qkv_b = 1 if cfg.bias or cfg.qkv_bias else 0
    norms_per_layer = cfg.parallel_norms if cfg.block == "parallel" else 2
    per_layer = (
        (h + qkv_b) * cfg.qkv_width  # qkv
        + h * h
        + h * b  # attention output
        + norms_per_layer * norm_parameters(cfg)
        + (2 * cfg.head_dim if cfg.qk_norm else 0)  # query and key head norms
    )
    mlps = sum(_mlp_layer_parameters(cfg, i) for i in range(cfg.layers))
    embed = v * h + (cfg.seq_len * h if cfg.positions == "learned" else 0)
    head = 0 if cfg.tie_embeddings else v * h
    return cfg.layers * per_layer + mlps + embed + norm_parameters(cfg) + head


def mlp_parameters(cfg: ModelConfig, width: int) -> int:
    """One MLP (a dense block's, an expert's, the shared expert's) of hidden width `width`."""
    b = 1 if cfg.bias else 0
    return (cfg.hidden + b) * width * (2 if cfg.mlp == "swiglu" else 1) + width * cfg.hidden + cfg.hidden * b


def _mlp_layer_parameters(cfg: ModelConfig, index: int) -> int:
    """Block `index`'s MLP: dense, or router + every expert + shared expert (and its gate) (+ routing bias)."""
    moe = cfg.moe
    if not moe.is_moe_layer(index):
        return mlp_parameters(cfg, cfg.ffn)
    shared = mlp_parameters(cfg, moe.shared_ffn_hidden) if moe.shared_ffn_hidden else 0
    shared += cfg.hidden if moe.shared_gate else 0
    bias = moe.experts if moe.bias_balancing else 0
    return cfg.hidden * moe.experts + moe.experts * mlp_parameters(cfg, cfg.expert_ffn) + shared + bias
