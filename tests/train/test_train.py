"""The single-process trainer learns, logs every step and records its configuration."""

import gc
import json
import os
import subprocess
import sys

import pytest

from megascale.config import default_config_path, load_config
from megascale.train.trainer import Trainer

pytestmark = pytest.mark.slow  # each test trains through a fresh process: out of the fast subset

TINY = [
    "--model.layers=2",
    "--model.hidden=64",
    "--model.heads=4",
    "--model.seq_len=64",
    "--model.window=32",
    "--train.global_batch=8",
    "--train.micro_batch=4",
    "--optim.lr=3e-3",
    "--train.tensorboard=false",
    "--checkpoint.every=0",
    "--checkpoint.resume=none",
]


def _trainer(tmp_path, *extra):
    cfg = load_config(
        default_config_path(),
        TINY + [f"--train.run_dir={tmp_path / 'run'}", *extra],
    )
    return Trainer(cfg)


def test_a_few_dozen_steps_lower_the_loss(tmp_path):
    trainer = _trainer(tmp_path, "--train.steps=36", "--train.eval_every=12", "--train.gc_every=10")
    try:
        losses = trainer.fit()
    finally:
        trainer.close()
    assert len(losses) == 36
    assert sum(losses[-6:]) / 6 < losses[0] - 0.25, losses
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 37))
    assert all(r["tokens_per_s"] > 0 and r["step_time"] > 0 for r in records)
    assert sum("eval_loss" in r for r in records) == 3
    assert (tmp_path / "run" / "config.toml").exists()
    assert gc.isenabled(), "automatic GC must be restored after training"


def test_gc_is_off_during_steps(tmp_path):
    trainer = _trainer(tmp_path, "--train.steps=2")
    seen = []
    original = trainer.train_step

    def spy(batch):
        seen.append(gc.isenabled())
        return original(batch)

    trainer.train_step = spy
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert seen == [False, False]


def test_deterministic_across_runs(tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = _trainer(tmp_path / name, "--train.steps=4", "--train.eval_every=0")
        try:
            runs.append(trainer.fit())
        finally:
            trainer.close()
    assert runs[0] == runs[1]


def test_cuda_requested_without_cuda_is_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from megascale.config import ConfigError

    with pytest.raises(ConfigError, match="train.device='cuda' but CUDA is not available"):
        _trainer(tmp_path, "--train.device=cuda")


@pytest.mark.parametrize(
    "extra",
    [
        ["--train.dtype=bf16"],
        ["--train.dtype=bf16", "--train.param_dtype=bf16"],
        ["--train.recompute=full", "--train.fuse_input_gemm=true"],
    ],
)
def test_precision_and_recompute_options_train_close_to_fp32(tmp_path, extra):
    def run(name, *opts):
        trainer = _trainer(tmp_path / name, "--train.steps=3", "--train.eval_every=0", *opts)
        try:
            return trainer.fit()
        finally:
            trainer.close()

    reference = run("fp32")
    other = run("other", *extra)
    exact = "--train.dtype=bf16" not in extra
    for a, b in zip(reference, other, strict=True):
        assert abs(a - b) <= (1e-5 if exact else 0.05) * abs(a), (reference, other)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--data.path=/nonexistent/tokens", "DataError: data directory /nonexistent/tokens does not exist"),
        ("--train.attention=flex", "ConfigError: train.attention='flex' trains only on CUDA"),
    ],
)
def test_cli_reports_bad_input_in_one_line(tmp_path, override, message):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "train",
            "--train.device=cpu",
            "--train.steps=1",
            f"--train.run_dir={tmp_path}",
            override,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_run_resumed_at_its_last_step_still_reports_the_step(tmp_path):
    """The driver learns a rank's step from its step hook: a rank that resumes at the final step
    runs no step, and without this report it looked like a rank that exited before training."""
    extra = (
        "--train.steps=2",
        "--checkpoint.every=2",
        "--checkpoint.resume=auto",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
    )
    first = _trainer(tmp_path, *extra)
    try:
        first.fit()
    finally:
        first.close()
    again = _trainer(tmp_path, *extra)
    reported = []
    again.step_hooks.append(lambda step, seconds: reported.append((step, seconds)))
    try:
        assert again.fit() == []
    finally:
        again.close()
    assert reported == [(2, 0.0)]
