"""The watchdog thread dumps a rank's state once when a span or a step overruns its timeout."""

from __future__ import annotations

import json
import os
import time

import pytest

from megascale.diagnostics.timers import Timers
from megascale.diagnostics.watchdog import FLIGHT_RECORDER_ENTRIES, Watchdog, enable_flight_recorder
from megascale.layout.grid import RankGrid
from megascale.plan.env import communication_env

pytestmark = pytest.mark.timeout(60)


def wait_for(path, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.02)
    raise AssertionError(f"{path} was not written in {timeout} s")


def test_dump_names_the_collective_and_coordinates(tmp_path) -> None:
    t = Timers(5, {"pp": 1, "dp": 0, "tp": 1}, "hostB", tmp_path)
    seen = []
    dog = Watchdog(
        t, tmp_path, timeout_s=0.3, grid=RankGrid(pp=2, dp=2, tp=2), poll_s=0.05, on_hang=seen.append
    ).start()
    roll = json.loads((tmp_path / "diagnostics" / "ranks" / "rank5.json").read_text())
    assert roll["host"] == "hostB" and RankGrid(**roll["grid"]) == RankGrid(pp=2, dp=2, tp=2)
    with t.span("backward"):
        time.sleep(0.1)
    t.end_step(0)
    assert not (tmp_path / "hang" / "rank5.json").exists()  # a healthy step: nothing
    with t.span("backward"), t.span("dp.reduce_scatter", "comm", op="reduce_scatter", group="dp"):
        dump = wait_for(tmp_path / "hang" / "rank5.json")
        time.sleep(0.3)
    dog.stop()
    assert dump["waiting"]["attrs"] == {"op": "reduce_scatter", "group": "dp", "seq": 1}
    assert [s["name"] for s in dump["open_spans"]] == ["backward", "dp.reduce_scatter"]
    assert dump["coords"] == {"pp": 1, "dp": 0, "tp": 1} and dump["last_step"] == 0
    assert dump["calls"] == {"comm:dp": 1}
    assert any("test_dump_names" in "".join(stack) for stack in dump["stacks"].values())
    assert len(seen) == 1  # once per stuck step, not at every poll


def test_step_overrun_without_open_span(tmp_path) -> None:
    t = Timers(0, {"pp": 0, "dp": 0, "tp": 0}, "h", tmp_path)
    t.end_step(0)
    dog = Watchdog(t, tmp_path, timeout_s=0.2, poll_s=0.05).start()
    dump = wait_for(tmp_path / "hang" / "rank0.json")
    dog.stop()
    assert dump["waiting"] is None and "step not finished" in dump["reason"]


def test_the_flight_recorder_has_one_size(monkeypatch):
    """The trainer turns the recorder on with the size the planner tells clusters to set."""
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    enable_flight_recorder()
    size = os.environ["TORCH_FR_BUFFER_SIZE"]
    assert size == str(FLIGHT_RECORDER_ENTRIES)
    assert {s.name: s.value for s in communication_env()}["TORCH_FR_BUFFER_SIZE"] == size
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "7")
    enable_flight_recorder()  # a size the environment chose is kept
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "7"
