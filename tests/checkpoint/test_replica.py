"""Peer copies (issue 20): a rank's state copied into memory, checked, and restored from it.

In-process with the real `Trainer`: a copy captured at step 10 restores a new trainer exactly (20
steps straight == 10 + restore + 10); a corrupted copy is refused and storage used instead; the
checks on a copy (partial, stale, edited) and the choice of a generation, on real copies."""

from __future__ import annotations

import copy as copying

import pytest

from megascale.checkpoint.manifest import validate
from megascale.checkpoint.replica import ReplicaStore, build_manifest, capture, choose, sealed, verify
from megascale.checkpoint.storage import CheckpointError
from megascale.train.trainer import Trainer
from tests.checkpoint.conftest import assert_same_params, tiny_config, train

LAYOUT = {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "vpp": 1, "ep": 1}


@pytest.fixture(scope="module")
def at_step_10(tmp_path_factory):
    """A trainer's sealed copy of step 10 (no storage checkpoint of that run)."""
    _, _, trainer = train(tmp_path_factory.mktemp("copy"), 10, "--checkpoint.every=0", keep_open=True)
    try:
        return sealed(capture(trainer.checkpoints.state, 0, 0, 1, LAYOUT))
    finally:
        trainer.close()


def resumed_from(run_dir, store: ReplicaStore, *overrides: str):
    trainer = Trainer(tiny_config(run_dir, "--train.steps=20", *overrides), replicas=store)
    try:
        losses = trainer.fit()
    finally:
        trainer.close()
    params = {n: p.detach().clone() for n, p in trainer.runner.named_parameters()}
    return losses, params, trainer


def test_a_copy_in_memory_restores_exactly(tmp_path, straight_run, at_step_10):
    store = ReplicaStore()
    store.keep(at_step_10, mine=True)
    losses, params, trainer = resumed_from(tmp_path, store, "--checkpoint.every=0")
    assert trainer.checkpoints.last_restore["source"] == "memory" and trainer.start_record["source"] == "memory"
    assert trainer.checkpoints.last_restore["bytes_read"] == 0  # nothing came from storage
    assert losses == straight_run[0][10:]
    assert_same_params(params, straight_run[1])


def test_a_corrupt_copy_is_refused_and_storage_is_used(tmp_path, straight_run, at_step_10):
    train(tmp_path, 10, "--checkpoint.every=5")  # storage has step 10 too
    bad = copying.deepcopy(at_step_10)
    bad.data[len(bad.data) // 2] ^= 0x01
    store = ReplicaStore()
    store.keep(bad, mine=True)
    losses, params, trainer = resumed_from(tmp_path, store, "--checkpoint.every=5")
    logged = (tmp_path / "rank00000.log").read_text()
    assert "rank-00000.bin: sha256 mismatch" in logged and "cannot be used" in logged
    assert trainer.checkpoints.last_restore["source"] == "storage"
    assert losses == straight_run[0][10:]
    assert_same_params(params, straight_run[1])
    assert store.own == {}  # copies past the restored step would belong to another timeline: none here


def test_storage_newer_than_the_copies_wins(tmp_path, at_step_10):
    train(tmp_path, 15, "--checkpoint.every=5")
    store = ReplicaStore()
    store.keep(at_step_10, mine=True)
    _, _, trainer = resumed_from(tmp_path, store, "--checkpoint.every=5")
    assert trainer.checkpoints.last_restore["source"] == "storage" and trainer.checkpoints.last_restore["step"] == 15


def test_every_defect_of_a_copy_is_named(at_step_10):
    header, data = at_step_10.header, at_step_10.data
    assert verify(header, bytearray(data), 0, (10, 0)).generation == (10, 0)
    with pytest.raises(CheckpointError, match="partial"):
        verify(header, data[:-1])
    flipped = bytearray(data)
    flipped[0] ^= 0xFF
    with pytest.raises(CheckpointError, match="corrupt"):
        verify(header, flipped)
    with pytest.raises(CheckpointError, match="stale or mixed"):
        verify(header, data, 0, (15, 0))
    with pytest.raises(CheckpointError, match="rank 0's"):
        verify(header, data, 1)
    edited = copying.deepcopy(header)
    edited["records"][0]["offset"] += 1
    with pytest.raises(CheckpointError, match="checksum"):
        verify(edited, data)
    with pytest.raises(CheckpointError, match="schema"):
        verify({**header, "size": "12"}, data)


def holding(step: int, rank: int, attempt: int = 0) -> dict:
    return {"step": step, "attempt": attempt, "rank": rank, "world_size": 2, "layout": LAYOUT, "sha256": "0" * 64}


def test_the_newest_generation_held_for_every_rank_is_chosen():
    # rank 0 holds its own steps 10 and 15 and rank 1's step 10; rank 1 (replaced) holds nothing
    held = [[holding(10, 0), holding(15, 0), holding(10, 1)], []]
    assert choose(held, 2, LAYOUT) == ((10, 0), {"rank-00000.bin": 0, "rank-00001.bin": 0})
    held[1] = [holding(15, 1), holding(10, 1)]  # rank 1 survived too: it reads its own files
    assert choose(held, 2, LAYOUT) == ((15, 0), {"rank-00000.bin": 0, "rank-00001.bin": 1})
    assert choose(held, 2, LAYOUT, skip={(15, 0)})[0] == (10, 0)
    mixed = [[holding(15, 0)], [holding(15, 1, attempt=1)]]  # same step, two timelines
    assert choose(mixed, 2, LAYOUT) is None
    assert choose(held, 2, {**LAYOUT, "dp": 2}) is None  # another layout: not these copies


def test_a_manifest_of_copies_is_a_valid_manifest(at_step_10):
    manifest = build_manifest([at_step_10.header], (10, 0), 1, LAYOUT, {"model": {}}, "r1")
    assert validate(manifest, "memory").step == 10
    with pytest.raises(CheckpointError, match="do not cover"):
        build_manifest([at_step_10.header], (15, 0), 1, LAYOUT, {"model": {}}, "r1")


def test_under_zero_the_restore_plan_spreads_whole_parameters_over_their_owners():
    """Each dp rank holds a shard of every parameter (ties everywhere): if one rank owned them all,
    it would rebuild and send every whole parameter dp-1 times alone (docs/fault_tolerance.md).
    Loaded into the same layout, no parameter needs an owner: each shard goes straight back."""
    from megascale.checkpoint.plan import Plan
    from megascale.layout.shard import ShardSpec

    world, params = 4, [f"blocks.{i}.weight" for i in range(16)]
    tensors, same, moved = [], [[] for _ in range(world)], [[] for _ in range(world)]
    for rank in range(world):
        for name in params:
            spec = ShardSpec((8, 8), flat_range=(16 * rank, 16 * (rank + 1))).to_json()
            tensors.append(
                {
                    "param": name,
                    "field": "value",
                    "spec": spec,
                    "dtype": "float32",
                    "shape": [16],
                    "file": f"rank-{rank:05d}.bin",
                    "offset": 64 * params.index(name),
                    "nbytes": 64,
                }
            )
            same[rank].append({"param": name, "field": "value", "spec": spec, "dtype": "float32"})
            other = ShardSpec((8, 8), flat_range=(8 + 16 * rank, 8 + 16 * (rank + 1))).to_json()  # ranges moved
            moved[rank].append({"param": name, "field": "value", "spec": other, "dtype": "float32"})
    files = {f"rank-{r:05d}.bin": {"size": 64 * len(params), "sha256": "0" * 64} for r in range(world)}
    manifest = {"tensors": tensors, "files": files}
    plan = Plan(manifest, moved)
    owners = [plan.owner[(name, "value")] for name in params]
    assert set(owners) == set(range(world)), owners  # before: rank 0 owned all 16
    plan = Plan(manifest, same)
    assert plan.owner == {} and all(plan.reader[tensors[idx]["file"]] == dst for idx, dst, _ in plan.direct)
