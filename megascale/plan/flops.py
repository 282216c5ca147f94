"""The FLOP conventions MFU is reported in, each labelled, so a prediction compares with a paper.

* `causal` (ours, `megascale.model.flops`): forward + backward = 3x forward; attention over
  the keys a token really attends to (causal mean span, the window under SWA); recomputation is
  not useful work.
* `full`: the same with attention counted over the whole span, `min(seq, window)` keys per
  token -- the PaLM convention (6N + 12 L H Q T, Chowdhery et al. 2022) that MegaScale's MFU and
  torchtitan's use.
* `megatron`: Narayanan et al. (SC'21) eq. 3, `96 B s l h^2 (1 + s/6h + V/16lh)` generalised to
  any MLP width: full attention, and with full recomputation the recomputed forward of the layers
  is counted (4 passes instead of 3); the vocabulary head is counted 3 times. Megatron-LM's
  "teraFLOP/s per GPU" (and BLOOM's) are in this convention.
"""

from __future__ import annotations

from megascale.config.schema import ModelConfig
from megascale.model.flops import attention_flops, flops_per_token, full_attention_span

CONVENTIONS = {
    "causal": "causal attention span, recomputation not counted (ours)",
    "full": "attention over the full span min(seq, window) (PaLM / MegaScale / torchtitan MFU)",
    "megatron": "Megatron eq. 3: full attention, recomputed forward counted (hardware FLOPs)",
}


def training_flops_per_token(model: ModelConfig, convention: str, recompute: str = "none") -> float:
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown FLOP convention {convention!r}; known: {list(CONVENTIONS)}")
    counted = flops_per_token(model)
    if convention == "causal":
        return counted.training
    span = full_attention_span(model.seq_len, model.window)
    layers = counted.dense + model.layers * attention_flops(span, model.hidden)
    passes = 4 if convention == "megatron" and recompute == "full" else 3
    return passes * layers + 3 * counted.head
