"""One reader per node through shared memory, on four real gloo ranks (tp=2 x dp=2)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

from megascale.data import DataError, build_loaders
from megascale.data.shm import PREFIX
from megascale.parallel import init_mesh
from megascale.testing.launch import run_local
from tests.data.conftest import job

pytestmark = pytest.mark.timeout(180)
STEPS = 6


def shm_segments(pids: set[int] | None = None) -> set[str]:
    """The loaders' segments in /dev/shm; with `pids`, only those these processes made (another
    test worker's job may hold its own)."""
    names = {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)}
    return names if pids is None else {n for n in names if _creator(n) in pids}


def _creator(name: str) -> int:
    return int(name[len(PREFIX) :].split("-")[0])


def _rank(path: str, modes: list[tuple[str, bool]], kill_reader_at: int, out: str) -> None:
    """Each (reader mode, prefetch) in turn on one mesh; results go to files (a killed rank
    returns nothing). Mode "resume" restarts a node-reader loader from step 3 of the first."""
    mesh, resume_state = None, None
    for mode, prefetch in modes:
        cfg = job(
            path,
            parallel__dp=2,
            parallel__tp=2,
            data__reader=mode.replace("resume", "node"),
            data__prefetch=prefetch,
            parallel__collective_timeout_s=60.0,
        )
        mesh = mesh or init_mesh(cfg.parallel, device="cpu")
        train, _ = build_loaders(cfg, mesh)
        if mode == "resume":
            train.next_batch()  # the ring is in use before the seek
            train.load_state_dict(resume_state)
        dist.barrier()  # every group's handshake is over
        group = train.reader_group
        pids: list[int] = [0] * mesh.world_size
        dist.all_gather_object(pids, os.getpid())
        result = {
            "rank": mesh.rank,
            "dp": mesh.dp_rank,
            "tp": mesh.tp_rank,
            "group": group.ranks if group else None,
            "reader": bool(group and group.is_reader),
            "segments_after_build": shm_segments(set(pids)),
        }
        batches, error = [train.next_batch()], None
        io_before = psutil.Process().io_counters().read_chars
        try:
            for step in range(1, STEPS - 3 if mode == "resume" else STEPS):
                if step == 3 and resume_state is None:
                    resume_state = train.state_dict()
                if step == kill_reader_at and result["reader"]:
                    torch.save(result, Path(out) / f"{mode}-rank{mesh.rank}.pt")
                    os.kill(os.getpid(), signal.SIGKILL)
                batches.append(train.next_batch())
        except DataError as exc:
            error = str(exc)
        result.update(
            error=error,
            read_chars=psutil.Process().io_counters().read_chars - io_before,
            inputs=torch.stack([b.inputs for b in batches]),
            labels=torch.stack([b.labels for b in batches]),
        )
        torch.save(result, Path(out) / f"{mode}-rank{mesh.rank}.pt")
        train.close()
        if error is not None:
            return
        dist.barrier()  # the next mode's reader must not start before this one's consumers end
    mesh.destroy()


def run_four(path: Path, tmp: Path, modes: list[tuple[str, bool]], kill_reader_at: int = -1) -> dict[str, list[dict]]:
    before = shm_segments()
    args = (str(path), modes, kill_reader_at, str(tmp))
    env = {"LOCAL_WORLD_SIZE": "4"}
    if kill_reader_at < 0:
        run_local(_rank, 4, args, env=env, timeout_s=150)
    else:
        with pytest.raises(RuntimeError, match="died"):
            run_local(_rank, 4, args, env=env, timeout_s=150)
    leaked = {n for n in shm_segments() - before if not psutil.pid_exists(_creator(n))}  # its maker is gone
    assert not leaked, f"shared memory segments leaked: {sorted(leaked)}"
    return {mode: [torch.load(tmp / f"{mode}-rank{r}.pt", weights_only=False) for r in range(4)] for mode, _ in modes}


@pytest.mark.slow
def test_shared_memory_batches_tp2_dp2(dataset, tmp_path):
    """node (prefetch on), tp (prefetch off), node resumed: right batches, one reader per
    group, the resumed run continues with the batches of the first."""
    path, _ = dataset
    single, _ = build_loaders(job(path), None)  # the same global batches as one process
    expected = [single.next_batch() for _ in range(STEPS)]
    single.close()
    runs = run_four(path, tmp_path, [("node", True), ("tp", False), ("resume", True)])
    for r, again in zip(runs["node"], runs.pop("resume"), strict=True):  # resumed at step 3
        assert torch.equal(r["inputs"][3:], again["inputs"])
        assert torch.equal(r["labels"][3:], again["labels"])
    for reader, results in runs.items():
        by = {(r["dp"], r["tp"]): r for r in results}
        for dp in (0, 1):  # tp peers identical
            assert torch.equal(by[dp, 0]["inputs"], by[dp, 1]["inputs"])
            assert torch.equal(by[dp, 0]["labels"], by[dp, 1]["labels"])
        assert not torch.equal(by[0, 0]["inputs"], by[1, 0]["inputs"])  # dp peers differ
        for step, whole in enumerate(expected):
            for key in ("inputs", "labels"):
                parts = [by[0, 0][key][step], by[1, 0][key][step]]
                assert torch.equal(torch.cat(parts), getattr(whole, key))
        readers = [r["rank"] for r in results if r["reader"]]
        groups = {r["group"] for r in results}
        if reader == "node":
            assert readers == [0] and groups == {(0, 1, 2, 3)}
        else:
            assert readers == [0, 2] and groups == {(0, 1), (2, 3)}
        for r in results:
            assert not r["segments_after_build"], "the name must be gone once all attached"
            if not r["reader"]:
                assert r["read_chars"] < 4096, f"rank {r['rank']} read {r['read_chars']} bytes"


def test_reader_killed_consumers_fail_and_nothing_leaks(dataset, tmp_path):
    results = run_four(dataset[0], tmp_path, [("node", False)], kill_reader_at=3)["node"]
    reader, consumers = results[0], results[1:]
    assert reader["reader"] and reader["rank"] == 0
    for r in consumers:
        assert r["error"] is not None and "died" in r["error"], r["error"]
        assert r["inputs"].shape[0] == 3  # the steps before the crash arrived


def _pipeline_rank(path: str) -> dict:
    cfg = job(path, parallel__pp=4, model__layers=4, data__reader="node")
    mesh = init_mesh(cfg.parallel, device="cpu")
    train, evaluation = build_loaders(cfg, mesh)
    batches = [train.next_batch() for _ in range(3)]
    evals = list(evaluation.batches())
    group = train.reader_group
    train.close()
    mesh.destroy()
    return {
        "pp": mesh.pp_rank,
        "group": group.ranks if group else None,
        # numpy: tensors would cross the result queue as shared memory of an exiting process
        "inputs": None if batches[0] is None else np.stack([b.inputs.numpy() for b in batches]),
        "evals": [e is None for e in evals],
    }


def test_only_first_and_last_stages_fetch(dataset):
    """pp=4 on four local ranks: stages 0 and 3 share one reader, stages 1 and 2 get None."""
    path, _ = dataset
    results = run_local(_pipeline_rank, 4, (str(path),), env={"LOCAL_WORLD_SIZE": "4"}, timeout_s=150)
    assert [r["inputs"] is None for r in results] == [False, True, True, False]
    assert [r["group"] for r in results] == [(0, 3), None, None, (0, 3)]
    assert [all(r["evals"]) for r in results] == [False, True, True, False]
    single, _ = build_loaders(job(path), None)
    expected = np.stack([single.next_batch().inputs.numpy() for _ in range(3)])
    single.close()
    assert np.array_equal(results[0]["inputs"], expected)
    assert np.array_equal(results[3]["inputs"], expected)
