"""`bench/peers.py` stays runnable and its two sides keep training the same model: megascale and
the PyTorch-native peer (DTensor TP + `torch.distributed.pipelining`) on one tiny tp=2, pp=2
(v=2) layout for a few alternating steps. Their losses and gradient norms must agree, and each
side must have measured its own tensor- and pipeline-parallel communication (a peer that
silently stopped sharding would still agree on the loss, but would have no tp or pp waits)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = "tp2pp2v2"


@pytest.mark.slow
def test_peer_bench_sides_train_the_same_model(tmp_path):
    out = tmp_path / "peers.json"
    command = [
        sys.executable,
        "bench/peers.py",
        "--layouts",
        LAYOUT,
        "--no-startup",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--layers",
        "4",
        "--seq-len",
        "16",
        "--global-batch",
        "4",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--out",
        str(out),
    ]
    done = subprocess.run(
        command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads(out.read_text())["layouts"][LAYOUT]

    assert row["losses_agree"] and row["losses_agree_on_every_rank"], row
    assert row["loss_max_rel_diff"] < 1e-5 and row["grad_norm_max_rel_diff"] < 1e-5, row
    for side in ("megascale", "peer"):
        assert len(row[side]["loss"]) == 3 and 0 < row[side]["loss"][0] < 10, row[side]
        assert row[side]["tokens_per_s"] > 0
        comm = row[side]["comm_s_per_step"]
        assert comm.get("tp", 0) > 0 and comm.get("pp", 0) > 0, (side, comm)
    assert f"{LAYOUT}: tokens/s megascale" in done.stdout  # the side-by-side lines are printed
