"""`--calibrate` and `--jitter-from` on a run directory written by the real timers and config code.

The run directory is what `megascale train` leaves: `config.toml` (dump_config) and per-rank
timer files (diagnostics.timers.Timers). The spans are recorded with known durations -- a known
multiple of the model's prediction per term -- so the fitted factors and the measured jitter
can be checked exactly. (The step's wall time is the real time between `end_step` calls, which
recorded spans cannot set, so the "step" row is not checked here.)
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from megascale.cli import main
from megascale.config import ConfigError, default_config_path, load_config
from megascale.config.loader import dump_config
from megascale.diagnostics.store import default_db_path
from megascale.diagnostics.timers import Timers
from megascale.plan.calibrate import calibrate, format_calibration
from megascale.plan.cost import estimate
from megascale.plan.layout import Features, Layout, Workload
from megascale.plan.stragglers import jitter_from_run

SPEED = {0: 0.95, 1: 1.05}  # rank 1's compute is 10% longer than rank 0's


def write_run(run_dir, cluster, compute_x=2.0, optimizer_x=3.0, comm_x=1.5, data_s=0.004, steps=4):
    cfg = load_config(
        None, ["--parallel.dp=2", "--train.global_batch=8", "--train.micro_batch=2", f"--train.run_dir={run_dir}"]
    )
    dump_config(cfg, run_dir / "config.toml")
    layout = Layout(dp=2, micro_batch=2, zero=2)
    est = estimate(Workload.from_job(cfg), layout, cluster, Features.from_job(cfg))
    t = est.terms
    spans = [
        ("data", "data", data_s),
        ("forward", "compute", compute_x * t["compute"]),
        ("dp.reduce_scatter", "comm", comm_x * (t["tp_exposed"] + t["dp_exposed"] + t["other"])),
        ("optimizer", "optimizer", optimizer_x * t["optimizer"]),
    ]
    for rank in (0, 1):
        timers = Timers(rank, {"pp": 0, "dp": rank, "tp": 0}, f"node{rank}", run_dir)
        for step in range(steps):
            total = sum(d for _, _, d in spans) * 1.2
            clock = time.perf_counter() - total
            for name, kind, dur in spans:
                dur *= SPEED[rank] if kind == "compute" else 1.0
                timers.record(name, kind, clock, clock + dur)
                clock += dur
            timers.end_step(step)
        timers.close()
    return est


@pytest.fixture
def run_dir(tmp_path, a100):
    cpu = replace(a100, gpu=replace(a100.gpu, peak_flops={"fp32": 50e9}, hbm_bytes_per_s=5e9))
    write_run(tmp_path, cpu)
    return tmp_path, cpu


def test_calibration_recovers_the_constants(run_dir):
    path, cpu = run_dir
    fit = calibrate([str(path)], cpu)
    terms = {t.term: t for t in fit.terms}
    assert terms["optimizer"].factor == pytest.approx(3.0, rel=1e-4)
    assert terms["optimizer"].error_after[0] == pytest.approx(0.0, abs=1e-4)
    # compute is measured at the slower rank (1.05 x 2.0 of the prediction), and fitted after
    # the optimizer fixed the memory bandwidth (element-wise work streams through it too)
    cfg = load_config(path / "config.toml")
    slower_memory = replace(cpu, gpu=replace(cpu.gpu, hbm_bytes_per_s=cpu.gpu.hbm_bytes_per_s / 3))
    before = estimate(Workload.from_job(cfg), Layout(dp=2, micro_batch=2), slower_memory, Features.from_job(cfg)).terms
    first = estimate(Workload.from_job(cfg), Layout(dp=2, micro_batch=2), cpu, Features.from_job(cfg)).terms
    assert terms["compute"].measured_s[0] == pytest.approx(2.1 * first["compute"], rel=1e-4)
    k = 2.1 * first["compute"] / before["compute"]
    assert terms["compute"].factor == pytest.approx(k, rel=1e-4)
    assert fit.cluster.gpu.gemm_efficiency == pytest.approx(cpu.gpu.gemm_efficiency / k, rel=1e-4)
    assert abs(terms["compute"].error_after[0]) < abs(terms["compute"].error_before[0])
    assert terms["collectives"].factor == pytest.approx(1.5, rel=0.1)
    assert terms["host"].measured_s[0] == pytest.approx(0.004, rel=1e-4)
    assert fit.implementation.host_overhead_s == pytest.approx(0.004, rel=1e-4)
    # jitter: each rank's compute over the stage mean, 3 steps after the warm-up
    assert sorted(fit.implementation.jitter.samples) == pytest.approx([0.95] * 3 + [1.05] * 3)
    text = format_calibration(fit)
    assert "gpu.gemm_efficiency" in text and "jitter: measured" in text


def test_jitter_from_run_feeds_the_straggler_term(run_dir, capsys):
    path, _ = run_dir
    calibrate([str(path)], run_dir[1])  # builds the timer database
    jitter = jitter_from_run(default_db_path(path))
    assert jitter.expected_max(2) == pytest.approx(0.95 * 0.25 + 1.05 * 0.75)
    code = main(
        [
            "plan",
            "--gpus",
            "64",
            "--batch",
            "64",
            "--model",
            str(default_config_path()),
            "--jitter-from",
            str(path),
            "--explain",
        ]
    )
    assert code == 0
    assert "measured (" in capsys.readouterr().out


def test_calibrate_cli_and_bad_input(run_dir, tmp_path, capsys):
    path, _ = run_dir
    assert main(["plan", "--calibrate", str(path), "--cluster", "a100-8x200g"]) == 0
    assert "fit: x" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plan", "--calibrate", str(empty)]) == 2
    assert "no config.toml" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no timer database"):
        jitter_from_run(empty / "nothing.sqlite")
