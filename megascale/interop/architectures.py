"""The transformers architectures megascale reads and writes, as model options and parameter names.

Each `Architecture` says, for one `model_type`: which megascale `ModelConfig` a config.json
describes (refusing, in one line, what has no megascale equivalent), which config.json describes
a `ModelConfig` it can express exactly, and where each megascale parameter lives in its state
dict (`rules.Rule`). GPT-2, GPT-NeoX, Llama, Mistral and Qwen 2 are mapped; the same option of
each maps to the same megascale option (docs/interop.md has the table). Mixtral, Qwen2-MoE and
Qwen3-MoE are the Llama layers with mixture-of-experts MLPs (megascale's `model.moe`;
`moe_mapping` maps them); Qwen3-MoE also normalises each query and key head (`model.qk_norm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megascale.config.fields import ConfigError
from megascale.config.schema import ModelConfig, MoEConfig, RopeScaling
from megascale.interop.hf_files import InteropError
from megascale.interop.moe_mapping import MOE_TYPES, moe_expressed, moe_rules, read_moe, write_moe
from megascale.interop.rules import Rule, copies, fused_qkv_conv1d, gate_up, same, separate_qkv, transposed

MAX_IMPORTED_SEQ_LEN = 8192  # a rotary model's training length is a choice, not its limit
GELU = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}  # HF name -> model.mlp
GELU_OUT = {"gelu": "gelu_new", "gelu_exact": "gelu"}


@dataclass(frozen=True)
class Architecture:
    model_type: str
    hf_class: str  # `architectures` in config.json: the AutoModelForCausalLM class
    prefix: str  # the base model's prefix in the state dict
    read: Callable[[dict], ModelConfig]  # config.json -> ModelConfig (raises InteropError)
    expresses: Callable[[ModelConfig], bool]  # this architecture computes exactly the ModelConfig's model
    write: Callable[[ModelConfig], dict]  # ModelConfig -> config.json keys
    names: Callable[[ModelConfig], dict[str, Rule]]  # megascale parameter -> where it lives


def _get(c: dict, *keys: str, default=None):
    for key in keys:
        if c.get(key) is not None:
            return c[key]
    if default is None:
        raise InteropError(f"config.json has none of {', '.join(keys)}")
    return default


def _refuse(model_type: str, what: str) -> InteropError:
    return InteropError(f"{model_type}: {what} has no megascale equivalent, so this checkpoint cannot be imported")


def _rope(c: dict, model_type: str, default_fraction: float = 1.0) -> dict:
    """rope_base, rotary_fraction and rope_scaling from either config.json format (transformers 4:
    rope_theta + rope_scaling; 5: rope_parameters; GPT-NeoX's rotary_emb_base + rotary_pct)."""
    params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        scaling = RopeScaling()
    elif kind == "llama3":
        scaling = RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    else:
        raise _refuse(model_type, f"rope_type {kind!r} (supported: default, llama3)")
    base = params.get("rope_theta", _get(c, "rope_theta", "rotary_emb_base", default=10000.0))
    fraction = params.get(
        "partial_rotary_factor", _get(c, "partial_rotary_factor", "rotary_pct", default=default_fraction)
    )
    return dict(rope_base=float(base), rotary_fraction=float(fraction), rope_scaling=scaling)


def _rope_out(m: ModelConfig) -> dict:
    """The transformers 4 keys (transformers 5 reads them too)."""
    out: dict = {"rope_theta": m.rope_base}
    s = m.rope_scaling
    out["rope_scaling"] = (
        None
        if s.kind == "none"
        else {
            "rope_type": s.kind,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_positions,
        }
    )
    return out


def _seq_len(c: dict, learned: bool) -> int:
    length = int(_get(c, "max_position_embeddings", "n_positions", default=2048))
    return length if learned else min(length, MAX_IMPORTED_SEQ_LEN)


def _max_positions(m: ModelConfig) -> int:
    s = m.rope_scaling
    return max(m.seq_len, int(s.original_max_positions * s.factor)) if s.kind == "llama3" else m.seq_len


def _shape(c: dict) -> dict:
    heads = int(_get(c, "num_attention_heads", "n_head"))
    hidden = int(_get(c, "hidden_size", "n_embd"))
    head_dim = c.get("head_dim")
    if head_dim not in (None, hidden // heads):
        raise _refuse(
            c.get("model_type", "?"), f"head_dim={head_dim} != hidden_size/num_attention_heads={hidden // heads}"
        )
    kv = int(c.get("num_key_value_heads") or heads)
    return dict(
        vocab_size=int(c["vocab_size"]),
        layers=int(_get(c, "num_hidden_layers", "n_layer")),
        hidden=hidden,
        heads=heads,
        kv_heads=0 if kv == heads else kv,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def _shape_out(m: ModelConfig) -> dict:
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "tie_word_embeddings": m.tie_embeddings,
    }


def _checked(m: ModelConfig, model_type: str) -> ModelConfig:
    try:
        m.validate()
    except ConfigError as exc:
        raise InteropError(f"{model_type}: {exc}") from exc
    return m


# ---------------------------------------------------------------- Llama, Mistral, Qwen 2, Mixtral, Qwen2-MoE


def _llama_read(model_type: str) -> Callable[[dict], ModelConfig]:
    def read(c: dict) -> ModelConfig:
        if c.get("hidden_act", "silu") != "silu":
            raise _refuse(model_type, f"hidden_act {c['hidden_act']!r} (megascale's SwiGLU uses silu)")
        attention_bias, mlp_bias = bool(c.get("attention_bias")), bool(c.get("mlp_bias"))
        if attention_bias != mlp_bias:
            raise _refuse(model_type, f"attention_bias={attention_bias} with mlp_bias={mlp_bias}")
        window = None
        if model_type in ("mistral", "mixtral"):
            window = c.get("sliding_window")
        elif model_type in ("qwen2", "qwen2_moe", "qwen3_moe"):
            window = _qwen2_window(c)
        return _checked(
            ModelConfig(
                **_shape(c),
                seq_len=_seq_len(c, learned=False),
                ffn_hidden=int(c["intermediate_size"]),
                block="serial",
                norm="rmsnorm",
                mlp="swiglu",
                window=window,
                positions="rotary",
                bias=attention_bias,
                qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(c.get("qkv_bias", True))),
                qk_norm=model_type == "qwen3_moe",
                norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                moe=read_moe(model_type, c) if model_type in MOE_TYPES else MoEConfig(),
                **_rope(c, model_type),
            ),
            model_type,
        )

    return read


def _moe_expresses(model_type: str) -> Callable[[ModelConfig], bool]:
    """Mixtral: no biases; Qwen2-MoE: QKV biases only; Qwen3-MoE: no biases, query/key head norms.
    All: `moe_mapping.moe_expressed`."""

    def expresses(m: ModelConfig) -> bool:
        biases = m.qkv_bias if model_type == "qwen2_moe" else not m.qkv_bias
        family = _llama_family(m, moe=True, qk_norm=model_type == "qwen3_moe")
        return family and not m.bias and biases and moe_expressed(model_type, m)

    return expresses


def _qwen2_window(c: dict) -> int | None:
    """Qwen 2 slides its window only in the layers from max_window_layers on."""
    types = c.get("layer_types")
    if types is None and c.get("use_sliding_window"):
        first = int(c.get("max_window_layers", 0))
        types = ["full_attention" if i < first else "sliding_attention" for i in range(c["num_hidden_layers"])]
    if not types or set(types) == {"full_attention"}:
        return None
    if set(types) != {"sliding_attention"}:
        raise _refuse("qwen2", "sliding-window attention in some layers only (max_window_layers / layer_types)")
    return int(c["sliding_window"])


def _llama_family(m: ModelConfig, moe: bool = False, qk_norm: bool = False) -> bool:
    """The Llama layers, with dense MLPs (or, `moe`, mixtures of experts), with query/key head
    norms or (`qk_norm` false) without."""
    return (
        m.qk_norm == qk_norm
        and m.block == "serial"
        and m.norm == "rmsnorm"
        and m.mlp == "swiglu"
        and m.positions == "rotary"
        and m.rotary_fraction == 1.0
        and (m.moe.experts > 0) == moe
    )


def _llama_write(model_type: str) -> Callable[[ModelConfig], dict]:
    def write(m: ModelConfig) -> dict:
        out = {
            **_shape_out(m),
            "num_key_value_heads": m.kv_groups,
            "intermediate_size": m.ffn,
            "hidden_act": "silu",
            "rms_norm_eps": m.norm_eps,
            "max_position_embeddings": _max_positions(m),
            **_rope_out(m),
        }
        if model_type in ("qwen2", "qwen2_moe", "qwen3_moe"):
            out.update(use_sliding_window=m.window is not None, sliding_window=m.window, max_window_layers=0)
        elif model_type in ("mistral", "mixtral"):
            out.update(sliding_window=m.window)
        else:
            out.update(attention_bias=m.bias, mlp_bias=m.bias)
        if model_type in MOE_TYPES:
            out.update(write_moe(model_type, m))
        return out

    return write


def _llama_names(model_type: str) -> Callable[[ModelConfig], dict[str, Rule]]:
    return lambda m: _llama_rules(model_type, m)


def _llama_rules(model_type: str, m: ModelConfig) -> dict[str, Rule]:
    rules = {"embed.tokens.weight": same("model.embed_tokens.weight"), "head.norm.weight": same("model.norm.weight")}
    if not m.tie_embeddings:
        rules["head.out.weight"] = same("lm_head.weight")
    for i in range(m.layers):
        hf, ms = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        rules[ms + "ln1.weight"] = same(hf + "input_layernorm.weight")
        rules[ms + "ln2.weight"] = same(hf + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if m.bias or m.qkv_bias else ("weight",):
            rules[ms + f"attn.qkv.{kind}"] = separate_qkv(
                *(f"{attn}{p}_proj.{kind}" for p in "qkv"), m.heads, m.kv_groups
            )
        rules[ms + "attn.proj.weight"] = same(attn + "o_proj.weight")
        if m.qk_norm:
            rules[ms + "attn.q_norm.weight"] = same(attn + "q_norm.weight")
            rules[ms + "attn.k_norm.weight"] = same(attn + "k_norm.weight")
        if m.moe.is_moe_layer(i):
            rules.update(moe_rules(model_type, m, hf, ms))
            continue
        rules[ms + "mlp.fc.weight"] = gate_up(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        rules[ms + "mlp.proj.weight"] = same(hf + "mlp.down_proj.weight")
        if m.bias:
            rules[ms + "attn.proj.bias"] = same(attn + "o_proj.bias")
            rules[ms + "mlp.fc.bias"] = gate_up(hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias")
            rules[ms + "mlp.proj.bias"] = same(hf + "mlp.down_proj.bias")
    return rules


def _llama_like(model_type: str, hf_class: str, expresses: Callable[[ModelConfig], bool]) -> Architecture:
    return Architecture(
        model_type,
        hf_class,
        "model.",
        _llama_read(model_type),
        expresses,
        _llama_write(model_type),
        _llama_names(model_type),
    )


# ---------------------------------------------------------------- GPT-2


def _gpt2_read(c: dict) -> ModelConfig:
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if c.get(key):
            raise _refuse("gpt2", f"{key}=true")
    if c.get("scale_attn_weights") is False:
        raise _refuse("gpt2", "scale_attn_weights=false")
    act = c.get("activation_function", "gelu_new")
    if act not in GELU:
        raise _refuse("gpt2", f"activation_function {act!r} (supported: {', '.join(GELU)})")
    shape = _shape(c)
    return _checked(
        ModelConfig(
            **{**shape, "tie_embeddings": bool(c.get("tie_word_embeddings", True))},
            seq_len=_seq_len(c, learned=True),
            ffn_hidden=int(c.get("n_inner") or 4 * shape["hidden"]),
            block="serial",
            mlp=GELU[act],
            positions="learned",
            bias=True,
            norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        ),
        "gpt2",
    )


def _gpt2_expresses(m: ModelConfig) -> bool:
    return (
        m.block == "serial"
        and m.norm == "layernorm"
        and m.mlp in GELU_OUT
        and m.positions == "learned"
        and m.bias
        and m.kv_groups == m.heads
        and m.window is None
        and not m.qk_norm
        and not m.moe.experts
    )


def _gpt2_write(m: ModelConfig) -> dict:
    return {
        "vocab_size": m.vocab_size,
        "n_embd": m.hidden,
        "n_layer": m.layers,
        "n_head": m.heads,
        "n_positions": m.seq_len,
        "n_inner": m.ffn,
        "activation_function": GELU_OUT[m.mlp],
        "layer_norm_epsilon": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
    }


def _gpt2_names(m: ModelConfig) -> dict[str, Rule]:
    rules = {
        "embed.tokens.weight": same("transformer.wte.weight"),
        "embed.positions.weight": same("transformer.wpe.weight"),
        "head.norm.weight": same("transformer.ln_f.weight"),
        "head.norm.bias": same("transformer.ln_f.bias"),
    }
    if not m.tie_embeddings:
        rules["head.out.weight"] = same("lm_head.weight")
    for i in range(m.layers):
        hf, ms = f"transformer.h.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            rules[ms + f"ln1.{kind}"] = same(hf + f"ln_1.{kind}")
            rules[ms + f"ln2.{kind}"] = same(hf + f"ln_2.{kind}")
            rules[ms + f"attn.qkv.{kind}"] = fused_qkv_conv1d(hf + f"attn.c_attn.{kind}", m.heads, kind == "bias")
        rules[ms + "attn.proj.weight"] = transposed(hf + "attn.c_proj.weight")
        rules[ms + "mlp.fc.weight"] = transposed(hf + "mlp.c_fc.weight")
        rules[ms + "mlp.proj.weight"] = transposed(hf + "mlp.c_proj.weight")
        for layer, name in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            rules[ms + f"{layer}.bias"] = same(hf + f"{name}.bias")
    return rules


# ---------------------------------------------------------------- GPT-NeoX


def _neox_read(c: dict) -> ModelConfig:
    act = c.get("hidden_act", "gelu")
    if act not in GELU:
        raise _refuse("gpt_neox", f"hidden_act {act!r} (supported: {', '.join(GELU)})")
    if c.get("attention_bias") is False:
        raise _refuse("gpt_neox", "attention_bias=false with the MLP's biases")
    parallel = c.get("use_parallel_residual", True)
    return _checked(
        ModelConfig(
            **_shape(c),
            seq_len=_seq_len(c, learned=False),
            ffn_hidden=int(c["intermediate_size"]),
            block="parallel" if parallel else "serial",
            parallel_norms=2 if parallel else 1,
            mlp=GELU[act],
            positions="rotary",
            bias=True,
            norm_eps=float(c.get("layer_norm_eps", 1e-5)),
            **_rope(c, "gpt_neox", default_fraction=0.25),
        ),
        "gpt_neox",
    )


def _neox_expresses(m: ModelConfig) -> bool:
    return (
        m.norm == "layernorm"
        and m.mlp in GELU_OUT
        and m.positions == "rotary"
        and m.bias
        and m.kv_groups == m.heads
        and m.window is None
        and not m.qk_norm
        and not m.moe.experts
    )


def _neox_write(m: ModelConfig) -> dict:
    return {
        **_shape_out(m),
        "intermediate_size": m.ffn,
        "hidden_act": GELU_OUT[m.mlp],
        "layer_norm_eps": m.norm_eps,
        "use_parallel_residual": m.block == "parallel",
        "max_position_embeddings": _max_positions(m),
        "attention_bias": True,
        "rotary_pct": m.rotary_fraction,
        "rotary_emb_base": m.rope_base,
        **_rope_out(m),
    }


def _neox_names(m: ModelConfig) -> dict[str, Rule]:
    rules = {"embed.tokens.weight": same("gpt_neox.embed_in.weight")}
    for kind in ("weight", "bias"):
        rules[f"head.norm.{kind}"] = same(f"gpt_neox.final_layer_norm.{kind}")
    if not m.tie_embeddings:
        rules["head.out.weight"] = same("embed_out.weight")
    for i in range(m.layers):
        hf, ms = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            first, second = hf + f"input_layernorm.{kind}", hf + f"post_attention_layernorm.{kind}"
            if m.block == "parallel" and m.parallel_norms == 1:  # MegaScale's one norm, written twice
                rules[ms + f"ln1.{kind}"] = copies(first, second)
            else:
                rules[ms + f"ln1.{kind}"], rules[ms + f"ln2.{kind}"] = same(first), same(second)
            rules[ms + f"attn.qkv.{kind}"] = same(hf + f"attention.query_key_value.{kind}")  # head-major already
            rules[ms + f"attn.proj.{kind}"] = same(hf + f"attention.dense.{kind}")
            rules[ms + f"mlp.fc.{kind}"] = same(hf + f"mlp.dense_h_to_4h.{kind}")
            rules[ms + f"mlp.proj.{kind}"] = same(hf + f"mlp.dense_4h_to_h.{kind}")
    return rules


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        _llama_like("llama", "LlamaForCausalLM", lambda m: _llama_family(m) and not m.qkv_bias and m.window is None),
        _llama_like(
            "mistral",
            "MistralForCausalLM",
            lambda m: _llama_family(m) and not m.bias and not m.qkv_bias and m.window is not None,
        ),
        _llama_like("qwen2", "Qwen2ForCausalLM", lambda m: _llama_family(m) and not m.bias and m.qkv_bias),
        _llama_like("mixtral", "MixtralForCausalLM", _moe_expresses("mixtral")),
        _llama_like("qwen2_moe", "Qwen2MoeForCausalLM", _moe_expresses("qwen2_moe")),
        _llama_like("qwen3_moe", "Qwen3MoeForCausalLM", _moe_expresses("qwen3_moe")),
        Architecture("gpt2", "GPT2LMHeadModel", "transformer.", _gpt2_read, _gpt2_expresses, _gpt2_write, _gpt2_names),
        Architecture(
            "gpt_neox", "GPTNeoXForCausalLM", "gpt_neox.", _neox_read, _neox_expresses, _neox_write, _neox_names
        ),
    )
}
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def architecture_of(config: dict) -> Architecture:
    """The mapping for a config.json, or a one-line refusal naming what is unsupported."""
    model_type = config.get("model_type")
    moe = [k for k in MOE_KEYS if config.get(k)]
    if moe and model_type not in MOE_TYPES:
        raise InteropError(
            f"model_type {model_type!r} is a mixture of experts ({moe[0]}={config[moe[0]]}) that "
            f"megascale does not map; of the mixtures of experts it imports {', '.join(MOE_TYPES)}"
        )
    if model_type not in ARCHITECTURES:
        raise InteropError(
            f"model_type {model_type!r} is not supported; megascale imports "
            f"{', '.join(sorted(ARCHITECTURES))} (and its own exports, model_type 'megascale')"
        )
    return ARCHITECTURES[model_type]


def standard_architecture(m: ModelConfig) -> Architecture | None:
    """The first architecture that computes exactly this model, or None (then: remote code)."""
    return next((a for a in ARCHITECTURES.values() if a.expresses(m)), None)
