"""Where a step's figures go: a progress line, `metrics.jsonl` and TensorBoard (rank 0 only)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("megascale")


def setup_logging(run_dir: Path, rank: int) -> None:
    """Rank 0 logs to stdout and run_dir/train.log; other ranks only to their own file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s [rank %(rank)s] %(message)s")
    handlers: list[logging.Handler] = [logging.FileHandler(run_dir / f"rank{rank:05d}.log")]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    log.handlers.clear()
    for handler in handlers:
        handler.setFormatter(fmt)
        handler.addFilter(_RankFilter(rank))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self._jsonl = open(run_dir / "metrics.jsonl", "a") if enabled else None  # noqa: SIM115
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, step: int, record: dict[str, float | int | None]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def progress_line(step: int, total: int, rec: dict) -> str:
    parts = [f"step {step:>{len(str(total))}}/{total}", f"loss {rec['loss']:.4f}"]
    if rec.get("eval_loss") is not None:
        parts.append(f"eval {rec['eval_loss']:.4f}")
    parts += [
        f"lr {rec['lr']:.2e}",
        f"gnorm {rec['grad_norm']:.3f}",
        f"{rec['tokens_per_s'] / 1e3:.1f}k tok/s",
    ]
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    parts.append(f"step {rec['step_time'] * 1e3:.0f} ms")
    parts.append(f"data wait {100 * rec['data_wait'] / max(rec['step_time'], 1e-9):.1f}%")
    return " | ".join(parts)
