"""A job that shrinks with the global batch kept trains the model one process trains.

The real `Trainer` (data loader, ZeRO, checkpoints) on gloo ranks: two steps at dp 4, saved,
then resumed at dp 3, where the global batch of 8 sequences (micro-batch 1) is split 3, 3, 2
(`resilience.shrink = "keep-batch"`), to step 4; against one process running the same 4 steps.
Every step's loss, its gradient (every element, as the optimizer receives it) and the final
parameters must agree to fp32 summation noise. The data loader's shared-memory ring (one reader
per node) serves the uneven shares, and the dp-4 ZeRO shards are resharded into dp 3 on resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from megascale.testing.launch import run_local

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINY = [
    "--model.layers=2",
    "--model.hidden=32",
    "--model.heads=2",
    "--model.seq_len=32",
    "--train.global_batch=8",
    "--train.micro_batch=1",
    "--train.device=cpu",
    "--train.tensorboard=false",
    "--train.eval_every=0",
    "--train.gc_every=0",
    "--checkpoint.every=2",
    "--optim.name=lamb",  # AdamW's sign-like steps would turn 1e-7 noise into 1e-4 (layout_parity.py)
    "--optim.warmup_steps=0",
    "--optim.decay_steps=8",
    "--parallel.backend=gloo",
]
STEPS = 4
LOSS_RTOL = 1e-6
GRAD_ATOL = 1e-6  # gradients are O(1e-2..1): summation order moves them by ~1e-8
PARAM_ATOL = 1e-6


def train(run_dir: str, steps: int, *overrides: str) -> dict:
    """Rank entry point: `Trainer.fit` to `steps`; returns the losses, each step's whole-shard
    gradients as the optimizer receives them, and (rank 0) the final parameters."""
    import torch

    from megascale.config import load_config
    from megascale.layout.shard import shard_spec
    from megascale.train.trainer import Trainer

    cfg = load_config(None, [*TINY, f"--train.run_dir={run_dir}", f"--train.steps={steps}", *overrides])
    trainer = Trainer(cfg)
    grads: list[list[tuple[str, int, np.ndarray]]] = []

    def capture(_optimizer: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
        step = []
        for name, shard in trainer.runner.optimizer_tensors():
            flat = shard_spec(shard).flat_range
            step.append((name, 0 if flat is None else flat[0], shard.grad.detach().reshape(-1).numpy().copy()))
        grads.append(step)

    trainer.optimizer.register_step_pre_hook(capture)
    try:
        losses = trainer.fit()
    finally:
        trainer.close()  # waits the parameters' all-gather: every rank then holds them whole
    params = {n: p.detach().numpy().copy() for n, p in trainer.runner.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params if trainer.mesh.dp_rank == 0 else {}}


def whole_grads(ranks: list[dict], shapes: dict[str, tuple[int, ...]]) -> list[dict[str, np.ndarray]]:
    """Per step, every parameter's gradient put together from the ranks' ZeRO shards."""
    steps = []
    for s in range(len(ranks[0]["grads"])):
        pieces: dict[str, list[tuple[int, np.ndarray]]] = {}
        for run in ranks:
            for name, start, grad in run["grads"][s]:
                pieces.setdefault(name, []).append((start, grad))
        steps.append(
            {
                name: np.concatenate([g for _, g in sorted(parts, key=lambda p: p[0])])[
                    : int(np.prod(shapes[name]))
                ].reshape(shapes[name])
                for name, parts in pieces.items()
            }
        )
    return steps


def spawn(world: int, run_dir: Path, steps: int, *overrides: str) -> list[dict]:
    os.environ.pop("RANK", None)
    return run_local(train, world, args=(str(run_dir), steps, *overrides), timeout_s=400)


def compare(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> float:
    """The largest gradient difference over the steps; asserts each is within GRAD_ATOL."""
    worst = 0.0
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for name in w:
            err = float(np.abs(g[name] - w[name]).max())
            assert err < GRAD_ATOL, f"step {s + 1}: {name}'s gradient differs by {err:.2e}"
            worst = max(worst, err)
    return worst


def grad_norms(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["grad_norm"] for line in lines]


def test_a_shrink_from_dp4_to_dp3_keeps_the_batch_and_trains_the_one_process_model(tmp_path):
    ref = train(str(tmp_path / "one"), STEPS, "--checkpoint.every=0")
    shapes = {n: p.shape for n, p in ref["params"].items()}
    want = whole_grads([ref], shapes)

    before = spawn(4, tmp_path / "shrunk", 2, "--parallel.dp=4")
    after = spawn(3, tmp_path / "shrunk", STEPS, "--parallel.dp=3")
    assert [len(r["losses"]) for r in before + after] == [2] * 7, "the dp-3 run must resume at step 2"
    got = whole_grads(before, shapes) + whole_grads(after, shapes)

    errors = {"loss_rel": 0.0, "grad_abs": 0.0, "param_abs": 0.0, "norm_rel": 0.0}
    for r, run in enumerate(before + after):
        part = ref["losses"][:2] if r < 4 else ref["losses"][2:]
        for a, b in zip(run["losses"], part, strict=True):
            errors["loss_rel"] = max(errors["loss_rel"], abs(a - b) / abs(b))
    errors["grad_abs"] = compare(got, want)
    for name, p in ref["params"].items():
        errors["param_abs"] = max(errors["param_abs"], float(np.abs(after[0]["params"][name] - p).max()))
    for a, b in zip(grad_norms(tmp_path / "shrunk"), grad_norms(tmp_path / "one"), strict=True):
        errors["norm_rel"] = max(errors["norm_rel"], abs(a - b) / b)
    print("shrink dp4 -> dp3 against one process:", errors)
    assert errors["loss_rel"] < LOSS_RTOL and errors["norm_rel"] < LOSS_RTOL, errors
    assert errors["param_abs"] < PARAM_ATOL, errors


def test_uneven_shares_through_a_pipeline_match_one_process(tmp_path):
    """dp 2 x pp 2 with a batch of 7: replica 0's pipeline runs 4 micro-batches, replica 1's 3
    (each 1F1B schedule and ZeRO reduce-scatter its own count)."""
    flags = ("--train.global_batch=7", "--model.tie_embeddings=false", "--checkpoint.every=0")
    ref = train(str(tmp_path / "one"), 2, *flags)
    shapes = {n: p.shape for n, p in ref["params"].items()}
    ranks = spawn(4, tmp_path / "pp", 2, *flags, "--parallel.dp=2", "--parallel.pp=2")
    assert all(len(r["losses"]) == 2 for r in ranks)
    loss = max(abs(a - b) / abs(b) for r in ranks for a, b in zip(r["losses"], ref["losses"], strict=True))
    grad = compare(whole_grads(ranks, shapes), whole_grads([ref], shapes))
    params = {n: p for r in ranks for n, p in r["params"].items()}
    assert params.keys() == ref["params"].keys()
    param = max(float(np.abs(params[n] - p).max()) for n, p in ref["params"].items())
    print("dp2 x pp2, batch 7 (4 + 3) against one process:", {"loss_rel": loss, "grad_abs": grad, "param_abs": param})
    assert loss < LOSS_RTOL and param < PARAM_ATOL, (loss, param)
