"""Resharding and read-once recovery across real gloo ranks.

A state cut by hand as (pp=1, dp=2, tp=2) with ZeRO is saved by 4 ranks (asynchronously,
committed by rank 0's writer), then loaded into (pp=2, dp=2, tp=1) with ZeRO and into (dp=4)
replicated through a filesystem that counts every byte read (one spawn), and into one process.
Saving and loading unpickle nothing (issue 29: the metadata ranks exchange is parsed JSON).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from megascale.config.schema import ParallelConfig
from megascale.parallel.store import free_port
from megascale.testing.launch import run_local
from tests.checkpoint import sharded

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SEED, STEP = 11, 7


def _mesh(pp: int, dp: int, tp: int):
    from megascale.parallel.mesh import init_mesh

    return init_mesh(ParallelConfig(pp=pp, dp=dp, tp=tp, backend="gloo"), device="cpu")


def _save(root: str, layout: tuple[int, int, int]) -> dict:
    from megascale.checkpoint import CheckpointManager

    mesh = _mesh(*layout)
    try:
        random.seed(100 + mesh.rank)
        torch.manual_seed(100 + mesh.rank)
        cfg, state = sharded.build_state(mesh, zero=True, seed=SEED, root=root, step=STEP)
        with sharded.no_unpickling():
            manager = CheckpointManager(cfg, mesh, root, state)
            manager.save()
            next_draws = (random.random(), torch.rand(1).item())
            manager.close()
        return {"draws": next_draws, "result": manager.last_result}
    finally:
        mesh.destroy()


def _load(root: str, layout: tuple[int, int, int], zero: bool) -> dict:
    from megascale.checkpoint import CheckpointManager

    sharded.register_counting()
    mesh = _mesh(*layout)
    try:
        cfg, state = sharded.build_state(mesh, zero=zero, seed=None, root=root)
        with sharded.no_unpickling():
            manager = CheckpointManager(cfg, mesh, root, state)
            before = sharded.CountingFileSystem.bytes_read
            loaded = manager.resume()
        read = sharded.CountingFileSystem.bytes_read - before
        draws = (random.random(), torch.rand(1).item())
        manager.close()
        return {
            "loaded": loaded,
            "bad": sharded.check_state(state, SEED, STEP),
            "read": read,
            "restore": manager.last_restore,
            "draws": draws,
        }
    finally:
        mesh.destroy()


def _launch(fn, world: int, *args):
    os.environ.pop("RANK", None)
    return run_local(fn, world, args=args, timeout_s=200)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard") / "ckpt")
    results = _launch(_save, 4, root, (1, 2, 2))
    assert results[0]["result"][0] == "ok", results[0]
    return root, results


def _load_both(root: str, ports: list[int]) -> list[dict]:
    """Two recoveries in one spawn (a fresh mesh each): pp=2 x dp=2 with ZeRO, then dp=4
    replicated through the byte-counting filesystem."""
    out = []
    for (layout, zero, url), port in zip(
        (((2, 2, 1), True, root), ((1, 4, 1), False, sharded.counting_url(root))), ports, strict=True
    ):
        os.environ["MASTER_PORT"] = str(port)
        out.append(_load(url, layout, zero))
    return out


def test_reshard_and_read_once_at_dp4(saved):
    root, saves = saved
    results = _launch(_load_both, 4, root, [free_port(), free_port()])
    for rank, (pipeline_zero, dp4) in enumerate(results):
        assert pipeline_zero["loaded"] and pipeline_zero["bad"] == [], (rank, pipeline_zero)
        assert pipeline_zero["draws"] == saves[rank]["draws"], rank  # each rank's RNG continues
        assert dp4["loaded"] and dp4["bad"] == [], (rank, dp4["bad"])
    dp4 = [both[1] for both in results]
    stored = dp4[0]["restore"]["checkpoint_bytes"]
    read = sum(res["read"] for res in dp4)  # counted by the filesystem, on every rank
    assert read == stored, (read, stored)
    assert dp4[0]["restore"]["bytes_read"] == stored


def test_reshard_to_one_process(saved, monkeypatch):
    root, _ = saved
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    res = _load(root, (1, 1, 1), False)
    assert res["loaded"] and res["bad"] == [], res["bad"]
