"""Packed sequences over token stores: windows, train/validation split, shuffled order, mixture.

A sequence is a window of `seq_len + 1` tokens of the packed stream (windows step by `seq_len`,
so every token but the first is a label once); inputs are `w[:-1]`, labels `w[1:]`, and a label
whose input is an end-of-document token is masked (-100) unless `cross_document`. The last
`val_fraction` of each dataset's windows (after a one-window gap, so no token is shared) is the
validation split.

The order is a pure function of (seed, epoch, step): step `s` of training consumes the global
sequences `[s*G, (s+1)*G)`, the same for any dp degree, and dp rank `r` takes the `r`-th
contiguous slice. With a mixture, the dataset of each global position is drawn from the weights
by an RNG keyed by (seed, step); the per-dataset counters are the resumable state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from megascale.data.shards import DataError, TokenStore

IGNORE = -100
_MIX_KEY = 0x6D6978  # separates the mixture RNG stream from the shuffles
_VAL_KEY = 0x76616C


@dataclass
class Split:
    """The windows of one dataset: train window ids and validation window ids."""

    store: TokenStore
    seq_len: int
    train: int  # number of train windows: ids 0..train-1
    val: np.ndarray  # window ids of the validation split

    def window(self, idx: int) -> np.ndarray:
        return self.store.read(idx * self.seq_len, self.seq_len + 1)


def split_windows(store: TokenStore, seq_len: int, val_fraction: float, min_val: int) -> Split:
    windows = (store.tokens - 1) // seq_len
    n_val = max(math.ceil(val_fraction * windows), min_val) if val_fraction > 0 else 0
    n_train = windows - n_val - (1 if n_val else 0)
    if n_train < 1:
        raise DataError(
            f"{store.root}: {store.tokens} tokens make {windows} windows of {seq_len + 1}; too few "
            f"for a validation split of {n_val} windows plus training (lower model.seq_len, "
            f"data.val_fraction or train.global_batch, or prepare more data)"
        )
    val = np.arange(n_train + 1, windows, dtype=np.int64) if n_val else np.empty(0, np.int64)
    return Split(store, seq_len, n_train, val)


@dataclass
class GlobalOrder:
    """Which window every global sequence position reads, for training and evaluation."""

    splits: list[Split]
    weights: list[float]
    seed: int
    global_batch: int
    cross_document: bool
    _perms: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        total = sum(self.weights)
        self._p = np.array(self.weights, dtype=np.float64) / total
        val = [(d, int(w)) for d, s in enumerate(self.splits) for w in s.val]
        rng = np.random.default_rng([self.seed, _VAL_KEY])
        self._val = [val[i] for i in rng.permutation(len(val))] if val else []

    @property
    def val_windows(self) -> int:
        return len(self._val)

    def step_sources(self, step: int) -> np.ndarray:
        """The dataset index of each of the step's global positions."""
        if len(self.splits) == 1:
            return np.zeros(self.global_batch, dtype=np.int64)
        rng = np.random.default_rng([self.seed, _MIX_KEY, step])
        return rng.choice(len(self.splits), size=self.global_batch, p=self._p)

    def advance(self, step: int, consumed: list[int]) -> list[int]:
        counts = np.bincount(self.step_sources(step), minlength=len(self.splits))
        return [c + int(n) for c, n in zip(consumed, counts, strict=True)]

    def train_items(self, step: int, consumed: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
        """(dataset, window) of global positions [lo, hi) of `step`, given counters before it."""
        sources = self.step_sources(step)
        rank = np.empty(len(sources), dtype=np.int64)  # position among the step's picks of d
        for d in range(len(self.splits)):
            picked = np.flatnonzero(sources == d)
            rank[picked] = np.arange(len(picked))
        items = []
        for pos in range(lo, hi):
            d = int(sources[pos])
            epoch, offset = divmod(consumed[d] + int(rank[pos]), self.splits[d].train)
            items.append((d, int(self._perm(d, epoch)[offset])))
        return items

    def val_items(self, batch: int, lo: int, hi: int) -> list[tuple[int, int]]:
        base = batch * self.global_batch
        return [self._val[(base + pos) % len(self._val)] for pos in range(lo, hi)]

    def _perm(self, d: int, epoch: int) -> np.ndarray:
        key = (d, epoch)
        if key not in self._perms:
            if len(self._perms) > 2 * len(self.splits):  # keep the current epochs only
                self._perms.clear()
            rng = np.random.default_rng([self.seed, epoch, d])
            self._perms[key] = rng.permutation(self.splits[d].train)
        return self._perms[key]

    def sequences(self, items: list[tuple[int, int]], out: np.ndarray) -> None:
        """Fill `out[2, n, seq_len]` (inputs, labels) with the windows of `items`."""
        for i, (d, w) in enumerate(items):
            split = self.splits[d]
            tokens = split.window(w)
            out[0, i] = tokens[:-1]
            out[1, i] = tokens[1:]
            if not self.cross_document:
                out[1, i][tokens[:-1] == split.store.eod] = IGNORE
