"""Data pipeline: token shards, packed sequences, asynchronous and de-duplicated loading.

`prep` (cli.py) writes token shards; `build_loaders` gives each rank its train and eval loaders.
The embedded default corpus (Python's standard library, byte-level) needs no download.
Names are imported on first use, so that `megascale prep` and its workers never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_loaders": "megascale.data.build",
    "ensure_default_corpus": "megascale.data.corpus",
    "EvalLoader": "megascale.data.loader",
    "TokenBatch": "megascale.data.loader",
    "TrainLoader": "megascale.data.loader",
    "DataError": "megascale.data.shards",
    "EOD": "megascale.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megascale.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
