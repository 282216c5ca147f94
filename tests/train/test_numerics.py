"""Bad numbers in the real trainer: a non-finite gradient skips the step (and too many in a row
stop the run, naming the last good checkpoint); a poisoned batch makes a loss spike that is
skipped or rolled back so that the run continues exactly as a run that never had that batch;
precision settings that cannot work are refused at start."""

import json
import math

import pytest
import torch
from test_train import _trainer

from megascale.checkpoint.export import whole_tensors
from megascale.config import ConfigError, default_config_path, load_config
from megascale.optim import build_optimizer
from megascale.train.numerics import TrainingHalted

POISONED = 32  # loader position of the poisoned batch (step 33's): two steps after a checkpoint
SPIKE = [
    "--train.steps=36",
    "--train.eval_every=0",
    "--train.spike_window=8",
    "--checkpoint.every=10",
    "--optim.lr=1e-2",
    "--optim.warmup_steps=0",
    "--optim.decay_steps=200",
    "--checkpoint.async_save=false",
    "--train.log_every=100",
]


def _fit(trainer) -> list[float]:
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def _feed(trainer, drop: bool) -> None:
    """The loader's batch at POISONED gets labels of a byte text never has (a corrupt shard: a
    loss spike), or,
    with `drop`, is never seen (the reference run)."""
    loader = trainer.train_loader
    original = loader.next_batch

    def next_batch():
        at = loader.position
        batch = original()
        if at == POISONED and drop:
            return original()
        if at == POISONED:
            batch.labels = torch.ones_like(batch.labels)  # byte 0x01, absent from text
        return batch

    loader.next_batch = next_batch


@pytest.fixture(scope="module")
def never_saw_it(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference")
    trainer = _trainer(path, *SPIKE)
    _feed(trainer, drop=True)
    return _fit(trainer)


@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_a_spike_is_dropped_and_the_run_equals_one_that_never_saw_the_batch(tmp_path, never_saw_it, action):
    trainer = _trainer(tmp_path, *SPIKE, f"--train.spike_action={action}")
    _feed(trainer, drop=False)
    losses = _fit(trainer)
    assert losses == never_saw_it  # bit for bit, every step (those trained again after a rollback too)
    spikes = [r for r in _metrics(tmp_path) if r.get("spike")]
    assert len(spikes) == 1 and spikes[0]["step"] == POISONED + 1 and spikes[0]["skipped"] == 1, spikes
    assert spikes[0]["loss"] > 1.2 * never_saw_it[POISONED]  # measured: 5.69 against 3.96
    if action == "rollback":
        assert spikes[0]["rollback_to"] == 30 and spikes[0]["skipped_batches"] == [POISONED, POISONED]


def test_a_logged_spike_is_trained_on(tmp_path, never_saw_it):
    trainer = _trainer(tmp_path, *SPIKE)  # spike_action = "log"
    _feed(trainer, drop=False)
    losses = _fit(trainer)
    assert [r["step"] for r in _metrics(tmp_path) if r.get("spike")] == [POISONED + 1]
    assert losses[:POISONED] == never_saw_it[:POISONED] and losses[POISONED + 1 :] != never_saw_it[POISONED + 1 :]


def _poison_grads(trainer, attempts: set[int], value: float) -> None:
    """After the gradients are complete, one element of one gradient becomes `value` in the
    `attempts`-th steps run (1-based; a skipped step's number comes again)."""
    runner = trainer.runner
    finish = runner.finish_grads
    count = iter(range(1, 1000))

    def finish_grads():
        finish()
        if next(count) in attempts:
            name, tensor = runner.optimizer_tensors()[3]
            tensor.grad.view(-1)[0] = value

    runner.finish_grads = finish_grads


def test_a_non_finite_gradient_skips_the_step_and_too_many_stop_the_run(tmp_path):
    trainer = _trainer(
        tmp_path,
        "--train.steps=12",
        "--train.eval_every=0",
        "--checkpoint.every=4",
        "--checkpoint.async_save=false",
        "--train.max_skipped_steps=3",
    )
    _poison_grads(trainer, {3} | set(range(7, 20)), math.inf)
    before = {}
    trainer.step_hooks.append(
        lambda step, _: before.update({step: [t.detach().clone() for _, t in trainer.runner.optimizer_tensors()]})
    )
    with pytest.raises(TrainingHalted, match=r"3 consecutive steps .* last good checkpoint is step 4 in .*step_0+4"):
        _fit(trainer)
    records = _metrics(tmp_path)
    skipped = [(r["step"], r["skip_reason"]) for r in records if r.get("skipped")]
    # step 3 is trained again; step 6 never (its third attempt raises before its record is written)
    assert skipped == [(3, "nonfinite")] + [(6, "nonfinite")] * 2, skipped
    assert [r["step"] for r in records if not r.get("skipped")] == [1, 2, 3, 4, 5]
    assert records[2]["nonfinite_ranks"] == [0] and records[2]["skipped_total"] == 1
    for step, tensors in before.items():
        assert all(torch.isfinite(t).all() for t in tensors), step
    saved, _ = whole_tensors(
        str(tmp_path / "run" / "checkpoints" / "step_000000004"), fields=("value", "optim.exp_avg", "optim.exp_avg_sq")
    )
    assert all(torch.isfinite(t).all() and t.dtype == torch.float32 for t in saved.values())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--train.param_dtype=fp16", "train.param_dtype='fp16' is not supported: fp16 needs a dynamic loss scaler"),
        ("--train.dtype=fp16", "train.dtype='fp16' is not supported"),
        ("--train.reduce_dtype=fp8", "train.reduce_dtype must be one of ['fp32', 'bf16']"),
        (
            "--train.spike_action=rollback",
            "train.spike_action='rollback' restores the last checkpoint: it needs checkpoint.every > 0",
        ),
    ],
)
def test_bad_precision_settings_are_refused_by_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(default_config_path(), ["--checkpoint.every=0", override])


def test_an_optimizer_given_bf16_tensors_is_refused():
    """bf16 parameters handed to an optimizer directly (no fp32 masters) would keep bf16 state."""
    cfg = load_config(default_config_path(), ["--train.param_dtype=bf16"])
    weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="optim.name='lamb' would step on w in torch.bfloat16"):
        build_optimizer([("w", weight)], cfg.optim)
