"""What a user sees of a step: memory and ETA on the progress line, grouped tracker tags, and
Weights & Biases in offline mode, read back with the trackers' own formats."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from megascale.config import default_config_path, load_config
from megascale.train.metrics import StepClock, memory_record, progress_line, tag
from megascale.train.trainer import Trainer

TINY = [
    "--model.layers=2",
    "--model.hidden=32",
    "--model.heads=4",
    "--model.seq_len=32",
    "--train.global_batch=4",
    "--train.micro_batch=2",
    "--train.eval_every=0",
    "--checkpoint.every=0",
    "--checkpoint.resume=none",
]


def test_tags_are_grouped_and_the_line_shows_memory_and_eta():
    assert [tag(k) for k in ("loss", "eval_loss", "mfu", "mem_rss_peak_gib", "time_comm")] == [
        "train/loss",
        "eval/loss",
        "perf/mfu",
        "memory/rss_peak_gib",
        "time/comm",
    ]
    clock = StepClock(window=2)
    assert clock.eta_s(10.0, 5) == 50.0 and clock.eta_s(2.0, 4) == 24.0  # mean of the last two
    assert clock.eta_s(2.0, 3) == 6.0  # the slow first step has left the window
    rec = {
        "loss": 2.0,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 1e4,
        "step_time": 0.1,
        "data_wait": 0.0,
        "eta_s": 3725.0,
        **memory_record(torch.device("cpu")),
    }
    line = progress_line(7, 100, rec)
    assert "eta 1h02m" in line and f"rss {rec['mem_rss_peak_gib']:.2f} GiB" in line
    assert 0.05 < rec["mem_rss_peak_gib"] < 64  # this process, in GiB (ru_maxrss is KiB on Linux)


def _wandb_history(run_file) -> list[dict]:
    """History records of a W&B run file: a LevelDB-style log of `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, records, pending = run_file.read_bytes(), 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                records.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    return records


def test_trackers_get_grouped_tags_and_wandb_works_offline(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")  # what the trainer sets; undone after the test
    cfg = load_config(
        default_config_path(),
        TINY
        + [
            f"--train.run_dir={tmp_path / 'run'}",
            "--train.steps=3",
            "--train.tensorboard=true",
            "--train.wandb=true",
            "--train.wandb_mode=offline",
        ],
    )
    trainer = Trainer(cfg)
    try:
        losses = trainer.fit()
    finally:
        trainer.close()
    out = capsys.readouterr().out  # rank 0's log goes to stdout
    assert "memory after step 1: peak RSS" in out and "planner estimate" in out
    assert " | rss " in out and " | eta " in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["eta_s"] == 0 and all(r["mem_rss_peak_gib"] > 0 for r in records)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "memory/rss_peak_gib"} <= scalars
    assert not any("/" not in t for t in scalars)

    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == pytest.approx(losses)
