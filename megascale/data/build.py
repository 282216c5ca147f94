"""`build_loaders`: from the job config and mesh to this rank's train and eval loaders.

Everything that can be wrong with the data (missing or corrupted shards, a tokenizer other
than the model's, too little data for the split) is found here, before the first step.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from megascale.config.schema import DataConfig, JobConfig
from megascale.data.corpus import ensure_default_corpus
from megascale.data.dataset import GlobalOrder, split_windows
from megascale.data.loader import EvalLoader, Source, TrainLoader
from megascale.data.shards import DataError, TokenStore
from megascale.data.sharing import find_group, job_store, open_ring
from megascale.data.sources import OwnReads, RingReader, RingWriter, Shape
from megascale.data.tokenizer import describe, manifest_tokenizer

RING_SLOTS = 3  # shared-memory slots: the reader may run two steps ahead of the slowest rank
VOCAB_PAD = 128  # a model's vocabulary may be up to this much larger (padding, added tokens)


def dataset_paths(data: DataConfig) -> tuple[list[Path], list[float]]:
    """The datasets to read and their weights: the mixture, data.path, or the default corpus."""
    if data.mixture:
        return [Path(p) for p in data.mixture], list(data.mixture.values())
    if data.path:
        return [Path(data.path)], [1.0]
    return [ensure_default_corpus(data.cache_dir)], [1.0]


def check_tokenizer(stores: list[TokenStore], data: DataConfig, model_vocab: int) -> None:
    """Every dataset made by one tokenizer, the one `data.tokenizer` names, fitting a model of
    `model_vocab` (model.vocab_size) tokens."""
    first = stores[0].manifest["tokenizer"]
    for store in stores[1:]:
        other = store.manifest["tokenizer"]
        if _differences(other, first):
            raise DataError(
                f"data.mixture: {store.root} was made with tokenizer {describe(other)} but {stores[0].root} "
                f"with {describe(first)} (they differ in {', '.join(_differences(other, first))}); "
                f"a mixture needs one tokenizer: prep every dataset with the same one"
            )
    if data.tokenizer:
        expected = manifest_tokenizer(first, data.tokenizer).identity()
        if _differences(expected, first):
            raise DataError(
                f"{stores[0].root / 'manifest.json'}: made with tokenizer {describe(first)}, but "
                f"data.tokenizer={data.tokenizer} is {describe(expected)} (they differ in "
                f"{', '.join(_differences(expected, first))}); prep the data with that tokenizer or "
                f"set data.tokenizer to the one the data was made with"
            )
    vocab = int(first["vocab_size"])
    padded = -(-vocab // VOCAB_PAD) * VOCAB_PAD
    if not vocab <= model_vocab <= vocab + VOCAB_PAD:
        raise DataError(
            f"{stores[0].root / 'manifest.json'}: tokenizer {first.get('name')!r} has "
            f"{vocab} tokens but model.vocab_size={model_vocab}; set model.vocab_size to {vocab} "
            f"(or up to {VOCAB_PAD} more, e.g. {padded}, a multiple of {VOCAB_PAD})"
        )


_IDENTITY_KEYS = {
    "kind": "kind",
    "vocab_size": "vocabulary",
    "eod": "end-of-document id",
    "bos": "BOS id",
    "sha256": "sha256",
}


def _differences(a: dict, b: dict) -> list[str]:
    """What tells two tokenizer identities apart (names and paths may differ for the same file)."""
    return [label for key, label in _IDENTITY_KEYS.items() if a.get(key) != b.get(key)]


def open_order(
    data: DataConfig, verify: bool, *, seq_len: int, model_vocab: int, global_batch: int
) -> tuple[GlobalOrder, list[TokenStore]]:
    """Open every dataset, check it against the config (model.seq_len, model.vocab_size,
    train.global_batch) and lay out the global order."""
    paths, weights = dataset_paths(data)
    stores = [TokenStore(p, verify=verify) for p in paths]
    check_tokenizer(stores, data, model_vocab)
    splits = [split_windows(s, seq_len, data.val_fraction, global_batch) for s in stores]
    for split in splits:
        if split.train < global_batch:
            raise DataError(
                f"{split.store.root}: {split.train} training windows of {seq_len + 1} "
                f"tokens are fewer than train.global_batch={global_batch}"
            )
    order = GlobalOrder(splits, weights, data.seed, global_batch, data.cross_document)
    return order, stores


def fingerprint(data: DataConfig, seq_len: int, stores: list[TokenStore], weights: list[float]) -> str:
    """What decides the order of sequences (not the global batch, so dp may change on resume)."""
    key = {
        "data": [[s.manifest["tokens"], [sh["sha256"] for sh in s.manifest["shards"]]] for s in stores],
        "weights": weights,
        "seq_len": seq_len,
        "seed": data.seed,
        "val_fraction": data.val_fraction,
        "cross_document": data.cross_document,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def build_loaders(cfg: JobConfig, mesh: Any) -> tuple[TrainLoader, EvalLoader]:
    """This rank's loaders. `mesh` is a ParallelMesh, or None for one process.

    Collective over the job when data.reader is 'node' or 'tp': every rank must call it."""
    dp_rank = mesh.dp_rank if mesh is not None else 0
    needs_data = mesh is None or mesh.is_first_stage or mesh.is_last_stage
    shape = Shape(cfg.shares, cfg.model.seq_len)
    store = job_store(mesh)
    start_timeout, step_timeout = cfg.parallel.init_timeout_s, cfg.parallel.collective_timeout_s
    group = find_group(cfg.data.reader, mesh, store, start_timeout) if store else None
    verify = cfg.data.verify_checksums and needs_data and (group is None or group.is_reader)
    error = None
    try:
        vocab, batch = cfg.model.vocab_size, cfg.train.global_batch
        order, stores = open_order(cfg.data, verify, seq_len=cfg.model.seq_len, model_vocab=vocab, global_batch=batch)
    except DataError as exc:
        if group is None:
            raise
        error = exc
    ring = None
    if group is not None:
        slot_shape = shape.empty(len(group.dp_ranks)).shape
        ring = open_ring(group, store, slot_shape, RING_SLOTS, start_timeout, str(error) if error else None)
    if error is not None:
        raise error

    produce: Source = OwnReads(order, shape, dp_rank, needs_data)
    if group is not None and ring is not None:
        part = group.dp_ranks.index(dp_rank)
        if group.is_reader:
            produce = RingWriter(order, shape, ring, list(group.dp_ranks), part, group.me, step_timeout)
        else:
            produce = RingReader(ring, group.consumer_index, part, step_timeout, shape.micro_batches_of(dp_rank))

    def close() -> None:
        if ring is not None:
            ring.close()
        for store_ in stores:
            store_.close()

    key = fingerprint(cfg.data, cfg.model.seq_len, stores, order.weights)
    train = TrainLoader(order, produce, cfg.data.prefetch, key, on_close=close)
    train.reader_group = group
    evaluation = EvalLoader(order, shape, dp_rank, cfg.train.eval_batches, needs_data)
    return train, evaluation
