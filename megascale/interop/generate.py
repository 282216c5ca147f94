"""Text from a model: a megascale checkpoint or a Hugging Face directory (an export, or any
checkpoint `megascale import` reads), with the tokenizer its run trained with.

For looking at what a model writes, not for serving: one sequence, with a key/value cache (the
prompt runs once, then each new token alone: linear in the generated length). Greedy
(temperature 0) or sampled with a temperature and top-k from a seeded generator.
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
from megascale.interop.export import checkpoint_root
from megascale.interop.pretrained import load_pretrained
from megascale.interop.tokenizer_files import run_tokenizer
from megascale.model import GPT
from megascale.model.attention import KVCache


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
    tok = load_tokenizer(tokenizer) if tokenizer else run_tokenizer(manifest["config"])
    return Loaded(model.eval(), tok, f"checkpoint step {manifest['step']} at {path}")


def load_checkpoint(url: str) -> tuple[GPT, dict]:
    """A single-process GPT with the weights of the newest valid checkpoint at `url`."""
    tensors, manifest = whole_tensors(checkpoint_root(url))
    model = GPT(from_dict(ModelConfig, manifest["config"]["model"], prefix="model."))
    weights = {param: t for (param, _), t in tensors.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"head.out.weight"} if model.cfg.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(
            f"{url}: the checkpoint does not fit its model config (missing "
            f"{sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})"
        )
    return model, manifest


@torch.no_grad()
def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop: int | None = None,
    cache: bool = True,
) -> list[int]:
    """The prompt's continuation (new token ids only), ending early at `stop`. Learned positions
    limit the context to the model's seq_len (the oldest tokens drop out of the window; from then
    on every step runs the window again, as `cache=False` does from the start)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    context = model.cfg.seq_len if model.cfg.positions == "learned" else None
    ids, new = list(prompt), []
    attached = _attach_caches(model) if cache else False
    try:
        for step in range(max_new_tokens):
            if attached and context is not None and len(ids) > context:
                attached = _detach_caches(model)
            if attached:
                start = 0 if step == 0 else len(ids) - 1  # the prompt once, then the newest token
                logits = last_logits(model, torch.tensor([ids[start:]], device=device), start)
            else:
                window = ids if context is None else ids[-context:]
                logits = model(torch.tensor([window], device=device))[0, -1]
            token = _pick(logits.float(), temperature, top_k, generator)
            ids.append(token)
            new.append(token)
            if token == stop:
                break
    finally:
        _detach_caches(model)
    return new


def last_logits(model: GPT, tokens: torch.Tensor, offset: int) -> torch.Tensor:
    h = model.embed(tokens, offset)
    for block in model.blocks:
        h = block(h)
    return model.head.logits(h[:, -1:])[0, -1]


def _attach_caches(model: GPT) -> bool:
    for block in model.blocks:
        block.attn.cache = KVCache(block.attn.window)
    return True


def _detach_caches(model: GPT) -> bool:
    for block in model.blocks:
        block.attn.cache = None
    return False


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def encode_prompt(tokenizer: ByteTokenizer | HFTokenizer, text: str) -> list[int]:
    """The prompt as the training documents began: after the BOS, where the tokenizer adds one."""
    bos = [] if tokenizer.bos is None else [tokenizer.bos]
    return bos + [int(i) for i in tokenizer.encode(text.encode())]
