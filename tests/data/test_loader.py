"""Packed windows, label masking, dp slicing of the global batch, resume and the eval split."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megascale.data import EOD, build_loaders
from megascale.data.dataset import IGNORE
from tests.data.conftest import job


def one_rank_mesh(dp_rank: int, dp_size: int, pp_rank: int = 0, pp_size: int = 1):
    """Coordinates only: with data.reader='rank' the loader needs no process group."""
    return SimpleNamespace(
        dp_rank=dp_rank,
        dp_size=dp_size,
        tp_rank=0,
        tp_size=1,
        pp_rank=pp_rank,
        pp_size=pp_size,
        is_first_stage=pp_rank == 0,
        is_last_stage=pp_rank == pp_size - 1,
        rank=dp_rank,
        world_size=dp_size * pp_size,
    )


def take(loader, steps: int) -> list:
    return [loader.next_batch() for _ in range(steps)]


@pytest.mark.parametrize("prefetch", [False, True])
def test_batches_are_windows_of_the_stream_with_masked_document_starts(dataset, prefetch):
    path, docs = dataset
    stream = np.frombuffer(b"".join(d + b"\x00" for d in docs), np.uint8).astype(np.int64)
    stream[np.cumsum([len(d) + 1 for d in docs]) - 1] = EOD
    cfg = job(path, data__prefetch=prefetch)
    train, _ = build_loaders(cfg, None)
    batch = train.next_batch()
    assert batch.inputs.shape == (cfg.micro_batches, 2, 32) == batch.labels.shape
    assert batch.inputs.dtype == torch.int64
    for seq, lab in zip(batch.inputs.reshape(-1, 32), batch.labels.reshape(-1, 32), strict=True):
        start = int(np.flatnonzero(np.lib.stride_tricks.sliding_window_view(stream, 32).__eq__(seq.numpy()).all(1))[0])
        assert start % 32 == 0  # windows step by seq_len
        window = stream[start : start + 33]
        expect = window[1:].copy()
        expect[window[:-1] == EOD] = IGNORE
        assert torch.equal(lab, torch.from_numpy(expect))
    assert (batch.labels == IGNORE).any() or not (batch.inputs == EOD).any()
    train.close()


def test_cross_document_keeps_every_label(dataset):
    train, _ = build_loaders(job(dataset[0], data__cross_document=True), None)
    batch = train.next_batch()
    assert (batch.inputs == EOD).any() and not (batch.labels == IGNORE).any()
    train.close()


def test_dp_ranks_split_the_same_global_batch(dataset):
    path, _ = dataset
    single, _ = build_loaders(job(path), None)
    ranks = [build_loaders(job(path, parallel__dp=2), one_rank_mesh(r, 2))[0] for r in range(2)]
    for _ in range(3):
        whole = single.next_batch().inputs.reshape(-1, 32)
        parts = [loader.next_batch().inputs.reshape(-1, 32) for loader in ranks]
        assert not torch.equal(parts[0], parts[1])
        assert torch.equal(torch.cat(parts), whole)
    for loader in [single, *ranks]:
        loader.close()


def test_uneven_dp_ranks_split_the_same_global_batch_and_eval_batch(dataset):
    """dp 3 over 4 micro-batches of 2 (resilience.shrink='keep-batch'): 2, 1 and 1 micro-batches,
    contiguous runs of the batch one process reads, for training and for evaluation."""
    path, _ = dataset
    single, single_eval = build_loaders(job(path), None)
    loaders = [build_loaders(job(path, parallel__dp=3), one_rank_mesh(r, 3)) for r in range(3)]
    for _ in range(3):
        whole = single.next_batch().inputs
        parts = [train.next_batch().inputs for train, _ in loaders]
        assert [p.shape[0] for p in parts] == [2, 1, 1]
        assert torch.equal(torch.cat(parts), whole)
    wholes = [b.labels for b in single_eval.batches()]
    for b, want in enumerate(wholes):
        parts = [list(evaluation.batches())[b].labels for _, evaluation in loaders]
        assert torch.equal(torch.cat(parts), want)
    for loader in [single, *(train for train, _ in loaders)]:
        loader.close()


def test_middle_pipeline_stages_get_no_tokens(dataset):
    cfg = job(dataset[0], parallel__pp=3, model__layers=3)
    loaders = [build_loaders(cfg, one_rank_mesh(0, 1, pp, 3)) for pp in range(3)]
    got = [train.next_batch() for train, _ in loaders]
    assert got[1] is None and got[0] is not None and torch.equal(got[0].labels, got[2].labels)
    assert list(loaders[1][1].batches()) == [None, None]
    for train, _ in loaders:
        train.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_resume_gives_the_batches_of_an_uninterrupted_run(dataset, prefetch):
    cfg = job(dataset[0], data__prefetch=prefetch)
    full, _ = build_loaders(cfg, None)
    expected = take(full, 40)  # > one epoch of the small dataset
    first, _ = build_loaders(cfg, None)
    take(first, 17)
    state = first.state_dict()
    first.close()
    assert all(isinstance(v, int | str) for v in state.values())
    resumed, _ = build_loaders(cfg, None)
    resumed.load_state_dict(state)
    for want, got in zip(expected[17:], take(resumed, 23), strict=True):
        assert torch.equal(want.inputs, got.inputs) and torch.equal(want.labels, got.labels)
    for loader in (full, resumed):
        loader.close()


def test_epochs_reshuffle_and_cover_every_train_window(dataset):
    train, _ = build_loaders(job(dataset[0]), None)
    windows = train.order.splits[0].train
    steps = windows // 8
    seen = [tuple(s.tolist()) for b in take(train, 2 * steps) for s in b.inputs.reshape(-1, 32)]
    epoch0, epoch1 = seen[: steps * 8], seen[steps * 8 :]
    assert len(set(epoch0)) == len(epoch0) and epoch0 != epoch1
    train.close()


def test_eval_batches_are_fixed_and_disjoint_from_training(dataset):
    train, evaluation = build_loaders(job(dataset[0]), None)
    one = [b.inputs for b in evaluation.batches()]
    two = [b.inputs for b in evaluation.batches()]
    assert len(one) == 2 and all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    split = train.order.splits[0]
    assert split.val.min() > split.train  # tail split with a one-window gap: no shared token
    val_seqs = {tuple(s.tolist()) for b in one for s in b.reshape(-1, 32)}
    train_seqs = {tuple(s.tolist()) for b in take(train, split.train // 8) for s in b.inputs.reshape(-1, 32)}
    assert not val_seqs & train_seqs
    train.close()


def test_prefetch_prepares_the_next_batch_during_the_step(dataset):
    """A slow source (0.2 s per batch, like slow storage): with prefetch the batch is ready after
    a 0.4 s step, without it every call waits the full read."""
    from megascale.data.loader import TrainLoader

    base, _ = build_loaders(job(dataset[0], data__prefetch=False), None)

    def slow(step, consumed, stop):
        time.sleep(0.2)
        return base._produce(step, consumed, stop)

    waits = {}
    for prefetch in (True, False):
        loader = TrainLoader(base.order, slow, prefetch, base.fingerprint)
        loader.next_batch()
        waits[prefetch] = []
        for _ in range(3):
            time.sleep(0.4)
            loader.next_batch()
            waits[prefetch].append(loader.wait_seconds)
        loader.close()
    base.close()
    assert max(waits[True]) < 0.1 and min(waits[False]) >= 0.2, waits
