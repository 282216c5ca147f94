"""`megascale report` over a real `megascale train` run with pipeline and tensor parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megascale.cli import main
from megascale.diagnostics.store import Collector, query

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TRAIN = [
    "--model.layers=4",
    "--model.hidden=32",
    "--model.heads=2",
    "--model.seq_len=32",
    "--train.steps=4",
    "--train.global_batch=8",
    "--train.micro_batch=1",
    "--train.device=cpu",
    "--train.eval_every=0",
    "--train.tensorboard=false",
    "--checkpoint.every=0",
    "--optim.warmup_steps=0",
    "--parallel.pp=2",
    "--parallel.tp=2",
]


@pytest.mark.slow
def test_report_of_a_pp2_tp2_training_run(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "train",
            *TRAIN,
            "--nproc",
            "4",
            f"--train.run_dir={run_dir}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    assert main(["report", str(run_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["hang"] is None
    assert set(summary["figures"]) >= {"heatmap_host", "heatmap_grid", "breakdown", "mfu"}

    trace = json.loads((run_dir / "report" / "trace_by_pp.json").read_text())
    events = trace["traceEvents"]
    stages = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert stages == {"pp 0", "pp 1"}
    tracks = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert sorted(tracks) == [(0, 0), (0, 1), (1, 2), (1, 3)]  # one track per rank

    c = Collector(run_dir)
    c.poll()
    per_rank = query(
        c.conn,
        "SELECT rank, pp, tp, COUNT(*) AS steps, SUM(compute) AS compute,"
        " SUM(comm) AS comm, SUM(p2p) AS p2p, SUM(step_time) AS step"
        " FROM rank_steps GROUP BY rank ORDER BY rank",
    )
    groups = {
        r["g"]
        for r in query(
            c.conn, "SELECT DISTINCT json_extract(attrs, '$.group') AS g FROM spans WHERE kind IN ('comm', 'p2p')"
        )
    }
    c.close()
    assert [(r["rank"], r["pp"], r["tp"], r["steps"]) for r in per_rank] == [
        (0, 0, 0, 4),
        (1, 0, 1, 4),
        (2, 1, 0, 4),
        (3, 1, 1, 4),
    ]
    for r in per_rank:  # compute is kept apart from tp collectives and pipeline waits
        assert r["compute"] > 0 and r["comm"] > 0 and r["p2p"] > 0
        assert r["compute"] + r["comm"] + r["p2p"] <= r["step"] * 1.001
    assert {"tp", "pp"} <= groups
