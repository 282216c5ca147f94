"""Hugging Face interoperability: start training from a transformers checkpoint, deliver one.

`megascale import` maps a checkpoint directory (GPT-2, GPT-NeoX, Llama, Mistral, Qwen 2) to a
megascale config whose parameters are read lazily, per rank, from its safetensors
(`checkpoint.init_from`); `megascale export` writes a trained checkpoint back as that
architecture, or as self-contained remote code when no standard architecture computes the same
model; `megascale generate` shows what a model writes. docs/interop.md has the mapping.
"""
