"""The run's tokenizer, found from a checkpoint's config, and written beside an export.

Training records its tokenizer twice: `data.tokenizer` (a tokenizer.json, e.g. set by
`megascale import`) and the prepared data's manifest (kind and path of the tokenizer prep used).
An export gets that tokenizer.json with its tokenizer_config.json and special_tokens_map.json when
they sit beside it, or a minimal tokenizer_config.json, so `AutoTokenizer` loads it; the EOS and
BOS the data was prepared with (`--eod-token`, `--bos`) come from the manifest. The built-in
byte-level tokenizer (ids 0-255 are the bytes, 256 ends a document) is written as the equivalent
`tokenizers` byte-level BPE with no merges: the same ids for any text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megascale.data.shards import MANIFEST
from megascale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, manifest_tokenizer

BYTE_EOD_TOKEN = "<|endoftext|>"
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")


def run_tokenizer(job: dict) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a run (its config as a dict) trained with: `data.tokenizer` or the prepared
    data's, with the end-of-document and BOS tokens that data was prepared with."""
    data = job.get("data", {})
    datasets = list(data.get("mixture") or {}) or ([data["path"]] if data.get("path") else [])
    identity = _manifest_identity(Path(datasets[0])) if datasets else None
    if data.get("tokenizer"):
        spec = str(data["tokenizer"])
        if identity and spec not in ("bytes", "byte"):
            return manifest_tokenizer(identity, spec)
        return load_tokenizer(spec)
    if not datasets:
        return load_tokenizer("bytes")  # the embedded default corpus is byte-level
    if identity is None:
        raise FileNotFoundError(
            f"cannot tell the run's tokenizer: {Path(datasets[0]) / MANIFEST} is unreadable; pass --tokenizer"
        )
    return manifest_tokenizer(identity)


def _manifest_identity(dataset: Path) -> dict | None:
    try:
        return json.loads((dataset / MANIFEST).read_text())["tokenizer"]
    except (OSError, ValueError, KeyError):
        return None


def write_tokenizer(tok: ByteTokenizer | HFTokenizer, out: Path, max_length: int) -> None:
    """The tokenizer files in `out`: the tokenizer.json with the config files that sit beside it
    (or a minimal tokenizer_config.json naming its EOS and BOS)."""
    if isinstance(tok, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        eod_token, bos_token = BYTE_EOD_TOKEN, None
    else:
        shutil.copyfile(tok.path, out / "tokenizer.json")
        for name in COMPANIONS:
            if (tok.path.parent / name).is_file():
                shutil.copyfile(tok.path.parent / name, out / name)
        eod_token, bos_token = tok.eod_token, tok.bos_token
    if not (out / "tokenizer_config.json").is_file():
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
        }
        if eod_token:
            config["eos_token"] = eod_token
        if bos_token:
            config["bos_token"] = bos_token
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def tokenizer_spec(tokenizer_json: Path) -> str:
    """What `data.tokenizer` should say for a checkpoint's tokenizer.json: `bytes` for megascale's
    own byte-level tokenizer as an export writes it (data prepared byte-level then fits), else the file."""
    try:
        if json.loads(tokenizer_json.read_text()) == json.loads(byte_tokenizer_json()):
            return "bytes"
    except (OSError, ValueError):
        pass  # not ours: the data check names the problem with the file when training starts
    return str(tokenizer_json.resolve())


def byte_tokenizer_json() -> str:
    """megascale's byte-level tokenizer as a tokenizer.json (GPT-2's byte-to-character table)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOD_TOKEN])  # id 256 = EOD
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable bytes stand for themselves, the rest for characters from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table
