"""The GPT model, free of parallelism: parallel code is applied from megascale.parallel."""

from megascale.model.gpt import GPT, IGNORE_INDEX, MLP, Attention, Block, Embedding, Head

__all__ = ["GPT", "IGNORE_INDEX", "MLP", "Attention", "Block", "Embedding", "Head"]
