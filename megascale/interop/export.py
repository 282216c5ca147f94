"""`megascale export`: a checkpoint as a Hugging Face model directory that `transformers` loads.

When a standard architecture computes exactly the trained model (`standard_architecture`), the
export is that architecture: its model_type, config keys and parameter names, loadable by
`AutoModelForCausalLM.from_pretrained(dir)` with no remote code. Otherwise (the parallel block
with a sliding window, RMSNorm with GeLU, ...) it is model_type `megascale` with
`configuration_megascale.py` and `modeling_megascale.py` beside the weights and an `auto_map`,
loadable with `trust_remote_code=True`. Either way the run's tokenizer is written too, and
`megascale import`/`checkpoint.init_from` read the export back. A run that started from a
transformers checkpoint (`checkpoint.init_from`) keeps that config.json's settings -- its
`max_position_embeddings`, BOS/EOS/pad ids and every key megascale does not model -- with only
what training set written over them.
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
from megascale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from megascale.interop.architectures import standard_architecture
from megascale.interop.hf_files import InteropError, write_safetensors
from megascale.interop.pretrained import MEGASCALE_TYPE, MODEL_KEY
from megascale.interop.tokenizer_files import run_tokenizer, write_tokenizer

REMOTE = Path(__file__).resolve().parent / "remote"
REMOTE_FILES = ("configuration_megascale.py", "modeling_megascale.py")
DEFAULT_SHARD_BYTES = 5 << 30  # transformers' own default shard size
KEPT_FILES = ("generation_config.json",)  # copied from the checkpoint a run started from
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    model_type: str  # an architecture's, or "megascale" (remote code)
    files: list[Path]
    tokenizer: str  # where the tokenizer came from ("bytes" or a tokenizer.json)


def export(
    url: str,
    out: Path,
    dtype: torch.dtype | None = None,
    tokenizer: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Exported:
    """Write the newest valid checkpoint at `url` (a checkpoint, a checkpoint root or a run
    directory) to `out`, with `tokenizer` (default: the run's)."""
    tensors, manifest = whole_tensors(checkpoint_root(url))
    model = from_dict(ModelConfig, manifest["config"]["model"], prefix="model.")
    weights = {param: t if dtype is None else t.to(dtype) for (param, _), t in tensors.items()}
    tok = load_tokenizer(tokenizer) if tokenizer else run_tokenizer(manifest["config"])
    started = manifest["config"].get("checkpoint", {}).get("init_from") or None
    return write_export(
        model, weights, out, tok, int(manifest["step"]), max_shard_bytes, Path(started) if started else None
    )


def checkpoint_root(url: str) -> str:
    """A run directory (train.run_dir) stands for its `checkpoints/` root."""
    local = Path(url)
    if "://" not in url and not (local / "manifest.json").is_file() and (local / "checkpoints").is_dir():
        return str(local / "checkpoints")
    return url


def write_export(
    model: ModelConfig,
    weights: dict[str, torch.Tensor],
    out: Path,
    tokenizer: str | ByteTokenizer | HFTokenizer,
    step: int,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    started_from: Path | None = None,
) -> Exported:
    """`weights`: whole parameters by single-process name (a tied head stored once);
    `started_from`: the transformers checkpoint the run was initialised from, if any."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(tok, out, model.seq_len)
    arch = standard_architecture(model)
    if arch is None and model.moe.experts:
        raise InteropError(
            "a mixture-of-experts model exports as mixtral or qwen2_moe only (serial Llama layers, softmax "
            "top-k, no routing bias or capacity; mixtral: renormalised in every block, no shared expert; "
            "qwen2_moe: QKV biases and a gated shared expert); the remote-code export has no MoE layers"
        )
    if arch is None:
        config = remote_code_config(model)
        named = sorted(weights.items())
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, out / name)
    else:
        config = {"model_type": arch.model_type, "architectures": [arch.hf_class], **arch.write(model)}
        rules = arch.names(model)
        named = [
            (hf, t)
            for name in sorted(weights)
            for hf, t in zip(rules[name].sources, rules[name].split(weights[name]), strict=True)
        ]
    stored = next(iter(weights.values())).dtype
    config.update(eos_token_id=tok.eod, bos_token_id=tok.bos, torch_dtype=DTYPE_NAMES.get(stored, "float32"))
    config = kept_settings(config, started_from, out)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    files = write_safetensors(named, out, max_shard_bytes, metadata={"format": "pt", "megascale_step": str(step)})
    source = "bytes" if isinstance(tok, ByteTokenizer) else str(tok.path)
    return Exported(out, step, config["model_type"], files, source)


def kept_settings(config: dict, started_from: Path | None, out: Path) -> dict:
    """`config` over the config.json of the checkpoint the run started from (same model_type):
    what training did not set stays as it was; the position limit never shrinks to the
    training length; the EOS/BOS ids stay when the run's tokenizer has the same EOS."""
    original = started_from / "config.json" if started_from is not None else None
    if original is None or not original.is_file():
        return config
    try:
        base = json.loads(original.read_text())
    except (OSError, ValueError):
        return config
    if base.get("model_type") != config["model_type"]:
        return config
    merged = {**base, **config}
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(base.get(key), int) and key in config:
            merged[key] = max(base[key], config[key])
    eos = base.get("eos_token_id")
    if config["eos_token_id"] == eos or (isinstance(eos, list) and config["eos_token_id"] in eos):
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if key in base:
                merged[key] = base[key]
    for name in KEPT_FILES:
        if (started_from / name).is_file():
            shutil.copyfile(started_from / name, out / name)
    return merged


def remote_code_config(model: ModelConfig) -> dict:
    return {
        "model_type": MEGASCALE_TYPE,
        "architectures": ["MegascaleForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_megascale.MegascaleConfig",
            "AutoModelForCausalLM": "modeling_megascale.MegascaleForCausalLM",
        },
        MODEL_KEY: {**to_dict(model), "window": model.window},
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "max_position_embeddings": model.seq_len,
        "tie_word_embeddings": model.tie_embeddings,
        "use_cache": False,
    }
