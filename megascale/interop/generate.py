"""Text from a model: a megascale checkpoint or a Hugging Face directory (an export, or any
checkpoint `megascale import` reads), with the tokenizer its run trained with.

For looking at what a model writes, not for serving: one sequence, and the whole context is run
again for each new token (no key/value cache). Greedy (temperature 0) or sampled with a
temperature and top-k from a seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megascale.checkpoint.export import whole_tensors
from megascale.checkpoint.storage import CheckpointError
from megascale.config.loader import from_dict
from megascale.config.schema import ModelConfig
from megascale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from megascale.interop.pretrained import load_pretrained
from megascale.interop.tokenizer_files import run_tokenizer
from megascale.model import GPT


@dataclass
class Loaded:
    model: GPT
    tokenizer: ByteTokenizer | HFTokenizer
    source: str  # what was loaded, for the user


def load(path: str, tokenizer: str | None = None) -> Loaded:
    """A Hugging Face directory (it has a config.json) or a megascale checkpoint (directory or root)."""
    local = Path(path)
    if (local / "config.json").is_file():
        model, pretrained = load_pretrained(local)
        spec = tokenizer or (str(local / "tokenizer.json") if (local / "tokenizer.json").is_file() else None)
        if spec is None:
            raise FileNotFoundError(f"{local} has no tokenizer.json: pass --tokenizer (a tokenizer.json or 'bytes')")
        return Loaded(model.eval(), load_tokenizer(spec), f"{pretrained.architecture} model {local}")
    model, manifest = load_checkpoint(path)
    spec = tokenizer or run_tokenizer(manifest["config"])
    return Loaded(model.eval(), load_tokenizer(spec), f"checkpoint step {manifest['step']} at {path}")


def load_checkpoint(url: str) -> tuple[GPT, dict]:
    """A single-process GPT with the weights of the newest valid checkpoint at `url`."""
    tensors, manifest = whole_tensors(url)
    model = GPT(from_dict(ModelConfig, manifest["config"]["model"], prefix="model."))
    weights = {param: t for (param, _), t in tensors.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"head.out.weight"} if model.cfg.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(f"{url}: the checkpoint does not fit its model config (missing "
                              f"{sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")
    return model, manifest


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, stop: int | None = None) -> list[int]:
    """The prompt's continuation (new token ids only), ending early at `stop`. Learned positions
    limit the context to the model's seq_len (the oldest tokens drop out of the window)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    context = model.cfg.seq_len if model.cfg.positions == "learned" else None
    ids, new = list(prompt), []
    for _ in range(max_new_tokens):
        window = ids if context is None else ids[-context:]
        logits = model(torch.tensor([window], device=device))[0, -1].float()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < cut, float("-inf"))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        ids.append(token)
        new.append(token)
        if token == stop:
            break
    return new


def encode_prompt(tokenizer: ByteTokenizer | HFTokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(text.encode())]

