"""A tokenizer's end-of-document (EOS) and beginning-of-sequence (BOS) tokens, from its own files.

The order, as `transformers.AutoTokenizer` reads them: the EOS named in `tokenizer_config.json`
(or `special_tokens_map.json`) beside the tokenizer.json, then the token its post-processor puts
after a sequence, then a token with one of the usual EOS names, else one new id past the
vocabulary. BOS is what the tokenizer.json's post-processor puts before a sequence -- what
`AutoTokenizer(text)` of transformers 5 adds (it follows the post-processor, not
`add_bos_token`; a disagreement between the two is said in a note). `--eod-token TOKEN` and
`--bos TOKEN|none` override either; the choices are kept in the manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

from megascale.data.shards import DataError

EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<eod>")
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
PROBE = "a"  # encoded with and without special tokens to see what the post-processor adds


def configured(directory: Path, key: str) -> tuple[str, str] | None:
    """(token, file) for `key` (eos_token, bos_token) in the tokenizer's config files, or None."""
    for name in CONFIG_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError) as exc:
            raise DataError(f"{path} is not a readable JSON object ({exc}); fix or remove it") from exc
        if isinstance(value, dict):  # {"__type": "AddedToken", "content": ...}
            value = value.get("content")
        if isinstance(value, str) and value:
            return value, name
    return None


def added_by_template(tok) -> tuple[list[int], list[int]]:
    """(ids the post-processor puts before one sequence, ids it puts after it)."""
    encoding = tok.encode(PROBE, add_special_tokens=True)
    mask, ids = encoding.special_tokens_mask, encoding.ids
    inner = [i for i, m in enumerate(mask) if not m]
    if not inner:
        return [], []
    return ids[: inner[0]], ids[inner[-1] + 1 :]


class SpecialTokens:
    """Which EOS and BOS a tokenizer.json at `path` uses, why, and what the user chose."""

    def __init__(self, tok, path: Path, eod_token: str | None, bos: str | None):
        self.tok, self.path, self.notes = tok, path, []
        self.chosen = {k: v for k, v in (("eod_token", eod_token), ("bos", bos)) if v is not None}
        prefix, suffix = added_by_template(tok)
        self.eod_token, self.eod, self.eod_from = self._eos(eod_token, suffix)
        self.bos_token, self.bos, self.bos_from = self._bos(bos, prefix)

    def _id(self, token: str, where: str) -> int:
        found = self.tok.token_to_id(token)
        if found is None:
            raise DataError(f"{where}: {token!r} is not a token of {self.path}; name one of its tokens")
        return int(found)

    def _eos(self, override: str | None, suffix: list[int]) -> tuple[str | None, int, str]:
        if override:
            return override, self._id(override, "--eod-token"), "--eod-token"
        named = configured(self.path.parent, "eos_token")
        if named:
            token, file = named
            return token, self._id(token, str(self.path.parent / file)), file
        if len(suffix) == 1:
            return self.tok.id_to_token(suffix[0]), suffix[0], "post-processor"
        for name in EOD_NAMES:
            if (found := self.tok.token_to_id(name)) is not None:
                return name, int(found), "name"
        size = self.tok.get_vocab_size(with_added_tokens=True)
        self.notes.append(
            f"{self.path} has no end-of-document token (none in {', '.join(CONFIG_FILES)}, none "
            f"named {', '.join(EOD_NAMES)}); prep ends documents with a new id {size}, one past "
            f"the vocabulary (pass --eod-token TOKEN to use one of its tokens)"
        )
        return None, size, "new id"

    def _bos(self, override: str | None, prefix: list[int]) -> tuple[str | None, int | None, str]:
        if override == "none":
            return None, None, "--bos"
        if override:
            return override, self._id(override, "--bos"), "--bos"
        if len(prefix) > 1:
            raise DataError(
                f"{self.path}: its post-processor puts {len(prefix)} tokens {prefix} before each "
                f"sequence; pass --bos TOKEN (or --bos none) to say which one starts a document"
            )
        said = self._config_flag("add_bos_token")
        if said is not None and said != bool(prefix):
            self.notes.append(
                f"{self.path.parent / 'tokenizer_config.json'} says add_bos_token={str(said).lower()} "
                f"but the tokenizer.json's post-processor adds {'a BOS' if prefix else 'none'}; prep "
                f"follows the post-processor, as transformers' AutoTokenizer does (pass --bos to "
                f"choose)"
            )
        if prefix:
            return self.tok.id_to_token(prefix[0]), prefix[0], "post-processor"
        return None, None, "post-processor"

    def _config_flag(self, key: str) -> bool | None:
        path = self.path.parent / CONFIG_FILES[0]
        if not path.is_file():
            return None
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            return None  # configured() has named the problem already
        return value if isinstance(value, bool) else None
