"""Run `megascale train` as a user would (a tiny model, a few steps) for end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TINY = [
    "--model.layers=2",
    "--model.hidden=32",
    "--model.heads=2",
    "--model.seq_len=32",
    "--train.steps=4",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    "--train.device='cpu'",
    "--train.eval_every=0",
    "--train.tensorboard=false",
    "--checkpoint.every=0",
    "--optim.warmup_steps=0",
]


def train_cli(tmp_path: Path, name: str, extra: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    """`megascale train` with TINY + `extra` in its own run directory; asserts it succeeded."""
    run_dir = tmp_path / name
    cmd = [
        sys.executable,
        "-m",
        "megascale.cli",
        "train",
        *TINY,
        f"--train.run_dir='{run_dir}'",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc, run_dir


def cli_losses(tmp_path: Path, name: str, extra: list[str]) -> list[float]:
    _, run_dir = train_cli(tmp_path, name, extra)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]
