"""Small random transformers models, made with transformers' own config classes and saved with its
own `save_pretrained`: the checkpoints megascale imports in these tests are the library's files."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=1,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)

# name -> (model_type, config): every supported architecture, and the variants of its options
CASES = {
    "gpt2": (
        "gpt2",
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1
        ),
    ),
    "gpt2-untied-exact-gelu": (
        "gpt2",
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            n_inner=40,
            activation_function="gelu",
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
        ),
    ),
    "gpt_neox": ("gpt_neox", lambda: transformers.GPTNeoXConfig(**COMMON, rotary_pct=0.5)),
    "gpt_neox-serial-tied": (
        "gpt_neox",
        lambda: transformers.GPTNeoXConfig(
            **COMMON, use_parallel_residual=False, tie_word_embeddings=True, hidden_act="gelu_new"
        ),
    ),
    "llama-gqa-llama3-rope": (
        "llama",
        lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2, rope_scaling=LLAMA3, rope_theta=500000.0),
    ),
    "mistral-swa": ("mistral", lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=8)),
    "qwen2-tied": (
        "qwen2",
        lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "mixtral-gqa": (
        "mixtral",
        lambda: transformers.MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    ),
    # Qwen2-MoE: a sigmoid-gated shared expert, QKV biases, gates not renormalised by default
    "qwen2_moe-gqa": (
        "qwen2_moe",
        lambda: transformers.Qwen2MoeConfig(**COMMON, num_key_value_heads=2, **QWEN_MOE),
    ),
    # ... renormalised, and every other block dense (decoder_sparse_step), tied
    "qwen2_moe-sparse-step-tied": (
        "qwen2_moe",
        lambda: transformers.Qwen2MoeConfig(
            **COMMON,
            **QWEN_MOE,
            num_key_value_heads=4,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-MoE: no shared expert, no biases, each query and key head RMS-normalised
    "qwen3_moe-gqa-qk-norm": (
        "qwen3_moe",
        lambda: transformers.Qwen3MoeConfig(
            **COMMON, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
        ),
    ),
}


def random_hf_model(config, seed: int = 0):
    """Every parameter random (norm weights and biases too), so a misplaced tensor shows."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def saved(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
