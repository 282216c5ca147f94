"""`megascale export`: a checkpoint as a Hugging Face model directory that `transformers` loads.

When a standard architecture computes exactly the trained model (`standard_architecture`), the
export is that architecture: its model_type, config keys and parameter names, loadable by
`AutoModelForCausalLM.from_pretrained(dir)` with no remote code. Otherwise (the parallel block
with a sliding window, RMSNorm with GeLU, ...) it is model_type `megascale` with
`configuration_megascale.py` and `modeling_megascale.py` beside the weights and an `auto_map`,
loadable with `trust_remote_code=True`. Either way the run's tokenizer is written too, and
`megascale import`/`checkpoint.init_from` read the export back.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megascale.checkpoint.export import whole_tensors
from megascale.config.loader import from_dict, to_dict
from megascale.config.schema import ModelConfig
from megascale.interop.architectures import standard_architecture
from megascale.interop.hf_files import write_safetensors
from megascale.interop.pretrained import MEGASCALE_TYPE, MODEL_KEY
from megascale.interop.tokenizer_files import run_tokenizer, write_tokenizer

REMOTE = Path(__file__).resolve().parent / "remote"
REMOTE_FILES = ("configuration_megascale.py", "modeling_megascale.py")
DEFAULT_SHARD_BYTES = 5 << 30  # transformers' own default shard size
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    model_type: str  # an architecture's, or "megascale" (remote code)
    files: list[Path]
    tokenizer: str  # where the tokenizer came from ("bytes" or a tokenizer.json)


def export(url: str, out: Path, dtype: torch.dtype | None = None, tokenizer: str | None = None,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Exported:
    """Write the newest valid checkpoint at `url` (or that checkpoint) to `out`, with `tokenizer`
    (default: the run's)."""
    tensors, manifest = whole_tensors(url)
    model = from_dict(ModelConfig, manifest["config"]["model"], prefix="model.")
    weights = {param: t if dtype is None else t.to(dtype) for (param, _), t in tensors.items()}
    spec = tokenizer or run_tokenizer(manifest["config"])
    return write_export(model, weights, out, spec, int(manifest["step"]), max_shard_bytes)


def write_export(model: ModelConfig, weights: dict[str, torch.Tensor], out: Path, tokenizer: str, step: int,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Exported:
    """`weights`: whole parameters by single-process name (a tied head stored once)."""
    out.mkdir(parents=True, exist_ok=True)
    _, eod = write_tokenizer(tokenizer, out, model.seq_len)
    arch = standard_architecture(model)
    if arch is None:
        config = remote_code_config(model)
        named = sorted(weights.items())
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, out / name)
    else:
        config = {"model_type": arch.model_type, "architectures": [arch.hf_class], **arch.write(model)}
        rules = arch.names(model)
        named = [(hf, t) for name in sorted(weights) for hf, t in
                 zip(rules[name].sources, rules[name].split(weights[name]), strict=True)]
    stored = next(iter(weights.values())).dtype
    config.update(eos_token_id=eod, torch_dtype=DTYPE_NAMES.get(stored, "float32"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    files = write_safetensors(named, out, max_shard_bytes, metadata={"format": "pt", "megascale_step": str(step)})
    return Exported(out, step, config["model_type"], files, tokenizer)


def remote_code_config(model: ModelConfig) -> dict:
    return {
        "model_type": MEGASCALE_TYPE, "architectures": ["MegascaleForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_megascale.MegascaleConfig",
                     "AutoModelForCausalLM": "modeling_megascale.MegascaleForCausalLM"},
        MODEL_KEY: {**to_dict(model), "window": model.window},
        "vocab_size": model.vocab_size, "hidden_size": model.hidden, "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads, "max_position_embeddings": model.seq_len,
        "tie_word_embeddings": model.tie_embeddings, "use_cache": False,
    }
