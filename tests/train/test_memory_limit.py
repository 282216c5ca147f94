"""`train.memory_limit_gib`: a sequence too long for one rank's memory is refused before anything
is allocated, with the layout that fits named, and trains under context parallelism.

The figures behind the limit are measured, not only estimated: PyTorch's MemTracker follows
every tensor a rank allocates from building its Trainer through one training step (parameters,
gradients, optimizer state, activations, buffers). At seq 4096 with a window of 128 one rank
holds ~50 MiB at cp1 and ~29 MiB at cp2 (the estimate: 47.3 and 24.9); full recomputation
alone leaves an estimated 32.2 MiB. The limit of 30 MiB sits between them: only cp fits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megascale.config import ConfigError, load_config
from megascale.diagnostics.tensor_memory import peak_tensor_bytes
from megascale.plan.memory import check_memory_limit
from megascale.testing.launch import run_local

pytestmark = pytest.mark.timeout(300)

LIMIT_GIB = 30 / 1024
LONG = [
    "--model.seq_len=4096",
    "--model.layers=2",
    "--model.hidden=64",
    "--model.heads=4",
    "--model.window=128",
    "--train.steps=1",
    "--train.global_batch=1",
    "--train.micro_batch=1",
    "--train.device='cpu'",
    "--train.eval_every=0",
    "--train.tensorboard=false",
    "--checkpoint.every=0",
    "--optim.warmup_steps=0",
]


def _config(tmp, *extra: str):
    return load_config(None, [*LONG, f"--train.run_dir={tmp / 'run'}", f"--data.cache_dir={tmp / 'cache'}", *extra])


def _measured_rank(tmp, extra: list[str]) -> int:
    """Tensor bytes this rank held at most, from building its Trainer through one step."""
    from megascale.train.trainer import Trainer

    cfg = _config(tmp, *extra)
    built: list[Trainer] = []

    def build_and_step() -> None:
        built.append(Trainer(cfg))
        built[0].run_step()

    peak = peak_tensor_bytes(build_and_step)
    built[0].close()
    return peak


def test_the_limit_names_cp_as_what_fits_and_passes_the_cp_layout(tmp_path):
    limit = f"--train.memory_limit_gib={LIMIT_GIB}"
    with pytest.raises(ConfigError) as refused:
        check_memory_limit(_config(tmp_path, limit), "cpu")
    message = str(refused.value)
    assert "train.memory_limit_gib" in message and "30.0 MiB" in message
    assert "parallel.cp=2 (2x the ranks): " in message
    assert "recompute" not in message  # full recomputation alone does not fit: not offered
    check_memory_limit(_config(tmp_path, limit, "--parallel.cp=2"), "cpu")
    check_memory_limit(_config(tmp_path), "cpu")  # 0: no limit
    with pytest.raises(ConfigError, match="train.memory_limit_gib must be >= 0"):
        _config(tmp_path, "--train.memory_limit_gib=-1")


def test_megascale_train_refuses_before_starting_and_the_trainer_too(tmp_path):
    cfg = _config(tmp_path, f"--train.memory_limit_gib={LIMIT_GIB}")
    cmd = [sys.executable, "-m", "megascale.cli", "train", *LONG, f"--train.memory_limit_gib={LIMIT_GIB}"]
    cmd += [f"--train.run_dir='{tmp_path / 'cli'}'", f"--data.cache_dir='{tmp_path / 'cache'}'"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: train.memory_limit_gib" in proc.stderr and "parallel.cp=2" in proc.stderr
    assert not (tmp_path / "cli").exists()  # refused before a log, a rank or a tensor
    from megascale.train.trainer import Trainer

    with pytest.raises(ConfigError, match="parallel.cp=2"):
        Trainer(cfg)  # the one home of the check: a launcher's ranks meet it too


def test_the_sequence_that_does_not_fit_one_rank_trains_under_cp2_within_the_limit(tmp_path):
    limit = LIMIT_GIB * 2**30
    (one,) = run_local(_measured_rank, 1, (tmp_path / "cp1", []), timeout_s=240)
    assert one > limit  # the refusal was true: one rank really holds more
    under_cp = run_local(
        _measured_rank,
        2,
        (tmp_path / "cp2", ["--parallel.cp=2", f"--train.memory_limit_gib={LIMIT_GIB}"]),
        timeout_s=240,
    )
    assert max(under_cp) <= limit, [f"{b / 2**20:.1f} MiB" for b in under_cp]
    assert max(under_cp) < 0.65 * one  # each cp rank holds about half of the sequence's activations


def test_megascale_launch_refuses_it_before_any_rank_starts(tmp_path, capsys):
    from megascale.cli import main

    run = [f"--train.run_dir={tmp_path / 'launch'}", f"--data.cache_dir={tmp_path / 'cache'}"]
    code = main(
        ["launch", "--nodes", "1", "--ranks-per-node", "1", *LONG, *run, f"--train.memory_limit_gib={LIMIT_GIB}"]
    )
    assert code == 2
    assert "megascale launch: config error: train.memory_limit_gib" in capsys.readouterr().err
    assert not (tmp_path / "launch").exists()
