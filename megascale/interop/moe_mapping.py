"""How the mixture-of-experts architectures (Mixtral, Qwen2-MoE, Qwen3-MoE) map `model.moe`.

Both are the Llama layers with MoE MLPs routed by softmax top-k; they differ in what else the
MLP holds and what their config.json calls it:

- Mixtral: every block, gates renormalised, no shared expert; `block_sparse_moe.experts.<e>.w1`
  (gate) / `w3` (up) / `w2` (down).
- Qwen2-MoE: blocks `(i + 1) % decoder_sparse_step == 0` (the others dense, of
  `intermediate_size`), gates renormalised only with `norm_topk_prob`, experts of
  `moe_intermediate_size`, and a shared expert whose output is scaled by a sigmoid gate
  (`shared_gate`); `mlp.experts.<e>.gate_proj` / `up_proj` / `down_proj`, `mlp.shared_expert.*`,
  `mlp.shared_expert_gate`. QKV biases as Qwen 2.
- Qwen3-MoE: Qwen2-MoE's routing and names without the shared expert; its attention has no
  biases and RMS-normalises each query and key head (`model.qk_norm`, mapped by the caller).

Neither has a router z-loss; the balancing loss coefficient carries over.
"""

from __future__ import annotations

from megascale.config.schema import ModelConfig, MoEConfig
from megascale.interop.hf_files import InteropError
from megascale.interop.rules import Rule, gate_up, same

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_EXPERT = {  # model_type -> (the MLP's name, an expert's gate, up, down projections)
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def read_moe(model_type: str, c: dict) -> MoEConfig:
    """config.json -> model.moe (raises InteropError for what megascale cannot compute)."""
    if model_type == "mixtral":
        return MoEConfig(
            experts=int(c["num_local_experts"]),
            top_k=int(c.get("num_experts_per_tok", 2)),
            normalize=True,
            aux_loss_coef=float(c.get("router_aux_loss_coef", 0.01)),
            z_loss_coef=0.0,
        )
    if c.get("mlp_only_layers"):
        raise InteropError(
            f"{model_type}: mlp_only_layers={c['mlp_only_layers']} has no megascale equivalent (model.moe.every "
            "picks the MoE blocks), so this checkpoint cannot be imported"
        )
    shared = int(c.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    if model_type == "qwen2_moe" and shared <= 0:
        raise InteropError("qwen2_moe: shared_expert_intermediate_size must be > 0 (megascale's gated shared expert)")
    return MoEConfig(
        experts=int(c.get("num_experts") or c["num_local_experts"]),
        top_k=int(c.get("num_experts_per_tok", 4)),
        every=int(c.get("decoder_sparse_step", 1)),
        ffn_hidden=int(c["moe_intermediate_size"]),
        normalize=bool(c.get("norm_topk_prob", False)),
        shared_ffn_hidden=shared,
        shared_gate=shared > 0,
        aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        z_loss_coef=0.0,
    )


def moe_expressed(model_type: str, m: ModelConfig) -> bool:
    """The architecture's MoE MLP computes exactly `m.moe` (the attention is checked by the caller)."""
    e = m.moe
    common = e.router == "softmax" and not e.bias_balancing and e.capacity_factor == 0
    if model_type == "mixtral":
        return common and e.every == 1 and e.normalize and not e.shared_ffn_hidden
    if model_type == "qwen3_moe":
        return common and not e.shared_ffn_hidden
    return common and e.shared_ffn_hidden > 0 and e.shared_gate


def write_moe(model_type: str, m: ModelConfig) -> dict:
    """model.moe -> config.json keys."""
    e = m.moe
    if model_type == "mixtral":
        return {
            "num_local_experts": e.experts,
            "num_experts_per_tok": e.top_k,
            "intermediate_size": m.expert_ffn,
            "router_aux_loss_coef": e.aux_loss_coef,
        }
    out = {
        "num_experts": e.experts,
        "num_experts_per_tok": e.top_k,
        "decoder_sparse_step": e.every,
        "mlp_only_layers": [],
        "moe_intermediate_size": m.expert_ffn,
        "norm_topk_prob": e.normalize,
        "router_aux_loss_coef": e.aux_loss_coef,
    }
    if model_type == "qwen3_moe":
        return {**out, "head_dim": m.head_dim, "attention_bias": False}
    return {**out, "shared_expert_intermediate_size": e.shared_ffn_hidden, "qkv_bias": True}


def moe_rules(model_type: str, m: ModelConfig, hf: str, ms: str) -> dict[str, Rule]:
    """Block parameters `ms + "mlp..."` <- transformers names under `hf` (a layer's prefix)."""
    block, gate, up, down = _EXPERT[model_type]
    moe = f"{hf}{block}."
    rules = {ms + "mlp.router.weight": same(moe + "gate.weight")}
    for e in range(m.moe.experts):
        w = f"{moe}experts.{e}."
        rules[ms + f"mlp.experts.{e}.fc.weight"] = gate_up(f"{w}{gate}.weight", f"{w}{up}.weight")
        rules[ms + f"mlp.experts.{e}.proj.weight"] = same(f"{w}{down}.weight")
    if m.moe.shared_ffn_hidden:
        shared = moe + "shared_expert."
        rules[ms + "mlp.shared.fc.weight"] = gate_up(shared + "gate_proj.weight", shared + "up_proj.weight")
        rules[ms + "mlp.shared.proj.weight"] = same(shared + "down_proj.weight")
        rules[ms + "mlp.shared_gate.weight"] = same(moe + "shared_expert_gate.weight")
    return rules
