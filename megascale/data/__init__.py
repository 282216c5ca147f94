"""Data pipeline: token shards, packed sequences, asynchronous and de-duplicated loading.

`prep` (cli.py) writes token shards; `build_loaders` gives each rank its train and eval loaders.
The embedded default corpus (Python's standard library, byte-level) needs no download.
"""

from megascale.data.build import build_loaders
from megascale.data.corpus import ensure_default_corpus
from megascale.data.loader import EvalLoader, TokenBatch, TrainLoader
from megascale.data.shards import DataError
from megascale.data.tokenizer import EOD

__all__ = ["EOD", "DataError", "EvalLoader", "TokenBatch", "TrainLoader", "build_loaders",
           "ensure_default_corpus"]
