"""The run's tokenizer, found from a checkpoint's config, and written beside an export.

Training records its tokenizer twice: `data.tokenizer` (a tokenizer.json, e.g. set by
`megascale import`) and the prepared data's manifest (kind and path of the tokenizer prep used).
An export gets that tokenizer.json with its tokenizer_config.json and special_tokens_map.json when
they sit beside it, or a minimal tokenizer_config.json, so `AutoTokenizer` loads it. The built-in
byte-level tokenizer (ids 0-255 are the bytes, 256 ends a document) is written as the equivalent
`tokenizers` byte-level BPE with no merges: the same ids for any text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megascale.data.shards import MANIFEST
from megascale.data.tokenizer import EOD, load_tokenizer

BYTE_EOD_TOKEN = "<|endoftext|>"
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")


def run_tokenizer(job: dict) -> str:
    """`bytes` or the path of the tokenizer.json a run (its config as a dict) trained with."""
    data = job.get("data", {})
    if data.get("tokenizer"):
        return str(data["tokenizer"])
    datasets = list(data.get("mixture") or {}) or ([data["path"]] if data.get("path") else [])
    if not datasets:
        return "bytes"  # the embedded default corpus is byte-level
    manifest = Path(datasets[0]) / MANIFEST
    try:
        identity = json.loads(manifest.read_text())["tokenizer"]
    except (OSError, ValueError, KeyError) as exc:
        raise FileNotFoundError(f"cannot tell the run's tokenizer: {manifest} is unreadable ({exc}); "
                                "pass --tokenizer") from exc
    return "bytes" if identity.get("kind") == "bytes" else str(identity["path"])


def write_tokenizer(spec: str, out: Path, max_length: int) -> tuple[str, int]:
    """The tokenizer files in `out`; returns (end-of-document token, its id)."""
    if spec in ("", "bytes", "byte"):
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        eod_token, eod = BYTE_EOD_TOKEN, EOD
    else:
        source = Path(spec)
        tok = load_tokenizer(spec)  # checks it is a tokenizer.json the library loads
        shutil.copyfile(source, out / "tokenizer.json")
        for name in COMPANIONS:
            if (source.parent / name).is_file():
                shutil.copyfile(source.parent / name, out / name)
        eod_token, eod = tok.eod_token, tok.eod
    if not (out / "tokenizer_config.json").is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                  "clean_up_tokenization_spaces": False}
        if eod_token:
            config["eos_token"] = eod_token
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return eod_token, eod


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
