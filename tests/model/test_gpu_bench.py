"""`bench/gpu/run.py --dry-run` stays runnable: a session that gets a GPU runs it first, with no
time to fix it. One compiled variant trains through the real Trainer; the others are listed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELECTED = "tiny parallel swa32 compile"


@pytest.mark.slow
@pytest.mark.timeout(900)  # compiling takes minutes on a loaded 2-core machine
def test_gpu_bench_dry_run(tmp_path, cpu_compiler):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "bench/gpu/run.py", "--dry-run", "--only", SELECTED],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_dry_run.json").read_text())

    assert report["dry_run"] and report["parity"], report
    # compiled blocks against eager (loss and gradients) and the unwindowed FlexAttention against
    # SDPA are checked only here: each compiles for ~25-50 s on 2 cores, so no unit test repeats them
    assert {"compile", "compile_flex", "flex_vs_sdpa_window_None", "flex_vs_sdpa_window_256"} <= report["parity"].keys()
    for check, diff in report["parity"].items():
        assert diff < 1e-5, f"{check}: {diff}"
    row = report["variants"].pop(SELECTED)
    assert row["tokens_per_s"] > 0 and row["mfu"] > 0, row
    assert 0 < row["final_loss"] < 10, row
    assert {"compute", "data", "optimizer"} <= set(row["time_by_kind_s"]), row
    assert len(report["variants"]) == 7
    assert all("not selected" in r["skipped"] for r in report["variants"].values()), report
    assert SELECTED in done.stdout  # the table is printed
