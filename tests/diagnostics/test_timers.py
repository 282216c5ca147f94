"""Timers: nesting accounting, file format, disabled cost, process-wide instance."""

from __future__ import annotations

import json
import time

import pytest
import torch

from megascale.diagnostics.timers import Timers, get_timers, gpu_origin, self_times, set_timers


def test_self_times_nested_and_overlapping() -> None:
    assert self_times([(0, 10), (2, 5), (3, 4)]) == [7, 2, 1]
    assert self_times([(0, 10), (8, 12)]) == [8, 4]  # loose overlap: the later one owns 8..12
    assert self_times([]) == []


def test_gpu_origin_is_exact_once_the_gpu_has_caught_up() -> None:
    # anchor recorded at host t=10 while the GPU was 0.5 s behind: it ran at t=10.5.
    # span 1 recorded at t=10.1 ran at 10.5..10.7 (queued); after a host sync at t=11,
    # span 2 recorded at t=11.0 ran at once, 11.0..11.2.
    spans = [(10.1, 10.12, 0.0, 0.2), (11.0, 11.01, 0.5, 0.2)]
    assert gpu_origin(10.0, spans) == 10.5
    assert gpu_origin(10.0, []) == 10.0  # nothing to learn from: the record time


def test_comm_inside_compute_is_not_compute(tmp_path) -> None:
    t = Timers(3, {"pp": 1, "dp": 0, "tp": 1}, "hostA", tmp_path)
    with t.span("forward"):
        time.sleep(0.02)
        with t.span("all_reduce", "comm", op="all_reduce", group="dp", seq=7):
            opened = t.current()
            time.sleep(0.03)
    t0 = time.perf_counter()
    time.sleep(0.01)
    t.record("wait", "comm", t0, time.perf_counter())
    totals = t.end_step(5)
    t.close()
    assert [s["name"] for s in opened] == ["forward", "all_reduce"]
    assert opened[1]["attrs"]["seq"] == 7 and t.current() == []
    assert 0.018 < totals["compute"] < 0.028
    assert 0.038 < totals["comm"] < 0.055
    assert totals["step"] >= totals["compute"] + totals["comm"]
    lines = (tmp_path / "timers" / "rank00003.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert {r["name"] for r in rows} == {"forward", "all_reduce", "wait", "step"}
    fwd = next(r for r in rows if r["name"] == "forward")
    assert fwd["host"] == "hostA" and fwd["step"] == 5
    assert fwd["coords"] == {"pp": 1, "dp": 0, "tp": 1}
    assert fwd["dur"] > 0.045 and fwd["self"] < 0.03
    assert abs(fwd["start"] - time.time()) < 60  # epoch seconds, comparable across hosts


def test_disabled_is_silent_and_cheap(tmp_path) -> None:
    t = Timers(0, {}, "h", tmp_path, enabled=False)
    with t.span("x", "comm"):
        pass
    t.record("y", "comm", 0.0, 1.0)
    assert t.end_step(0) == {} and t.current() == []
    assert not (tmp_path / "timers").exists()
    start = time.perf_counter()
    for _ in range(10000):
        with t.span("x"):
            pass
    assert (time.perf_counter() - start) / 10000 < 20e-6


def test_bad_kind_named() -> None:
    with pytest.raises(ValueError, match="'gpu'"):
        Timers(0, {}, "h", None).span("x", "gpu")


def test_process_wide_instance() -> None:
    before = get_timers()
    assert before.enabled is False
    mine = Timers(0, {}, "h", None)
    set_timers(mine)
    try:
        assert get_timers() is mine
    finally:
        set_timers(before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_spans_time_the_gpu_and_resolve_a_step_late(tmp_path) -> None:
    dev = torch.device("cuda")
    t = Timers(0, {"pp": 0}, "gpu0", tmp_path, device=dev)
    cycles = 20_000_000  # tens of ms of GPU time whatever the clock
    torch.cuda._sleep(10 * cycles)  # let the clocks ramp up first
    for step in range(3):
        torch.cuda.synchronize()  # as loss.item() would: the previous step is done on the GPU
        with t.span("data", "data"):
            time.sleep(0.01)  # waiting for the loader: host time, not GPU time
        with t.span("forward"):
            torch.cuda._sleep(2 * cycles)  # the host returns at once; the GPU is busy
            with t.span("all_reduce", "comm", op="all_reduce", group="dp"):
                torch.cuda._sleep(cycles)
        host_after = time.perf_counter()
        totals = t.end_step(step)
        assert time.perf_counter() - host_after < 0.005  # end_step did not wait for step's GPU
        if step == 0:
            assert totals == {}
        else:  # GPU time, not the microseconds the host spent launching
            assert totals["comm"] > 0.002, totals
            assert 1.5 < totals["compute"] / totals["comm"] < 3.0, totals
            assert 0.009 < totals["data"] < 0.05, totals
    t.close()
    rows = [json.loads(line) for line in (tmp_path / "timers" / "rank00000.jsonl").open()]
    assert sorted({r["step"] for r in rows}) == [0, 1, 2]
    for fwd, comm in zip(
        [r for r in rows if r["name"] == "forward"], [r for r in rows if r["name"] == "all_reduce"], strict=True
    ):
        assert fwd["start"] < comm["start"] and comm["dur"] > 0.002
        assert abs(fwd["dur"] - fwd["self"] - comm["dur"]) < 1e-4  # nested time left out


def test_first_step_excludes_the_set_up_before_it() -> None:
    t = Timers(0, {}, "h", None)
    time.sleep(0.2)  # building the model, the loaders ...
    with t.span("forward"):
        time.sleep(0.01)
    assert t.end_step(0)["step"] < 0.1
    time.sleep(0.05)  # after step one, everything between end_steps is the step
    assert t.end_step(1)["step"] >= 0.05
