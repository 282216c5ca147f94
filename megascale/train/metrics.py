"""Where a step's figures go: a progress line, `metrics.jsonl`, TensorBoard and optionally
Weights & Biases (rank 0 only), plus the memory and time figures the step adds to its record."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from collections import deque
from pathlib import Path
from typing import Any

import torch

from megascale.config.private_files import open_private

log = logging.getLogger("megascale")


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs to run_dir/rankNNNNN.log; rank 0 also to stdout."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s [rank %(rank)s] %(message)s")
    handlers: list[logging.Handler] = [_PrivateFileHandler(run_dir / f"rank{rank:05d}.log")]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    log.handlers.clear()
    for handler in handlers:
        handler.setFormatter(fmt)
        handler.addFilter(_RankFilter(rank))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class _PrivateFileHandler(logging.FileHandler):
    """A log file opened as `open_private` does: a link planted in the run directory is refused,
    never written through."""

    def _open(self):
        return os.fdopen(open_private(self.baseFilename), "a", encoding=self.encoding)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


# Tracker tags, grouped as dashboards show them: train/, eval/, perf/, memory/, time/.
_GROUPS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "eval_loss": "eval/loss",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time": "perf/step_time",
    "data_wait": "perf/data_wait",
    "eta_s": "perf/eta_s",
}


def tag(key: str) -> str:
    """`loss` -> `train/loss`, `mem_rss_gib` -> `memory/rss_gib`, `time_comm` -> `time/comm`."""
    if key in _GROUPS:
        return _GROUPS[key]
    for prefix, group in (("mem_", "memory/"), ("time_", "time/")):
        if key.startswith(prefix):
            return group + key.removeprefix(prefix)
    return f"other/{key}"


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, wandb: dict[str, Any] | None = None):
        """`wandb`: `{"project", "mode", "name", "config"}` to log to Weights & Biases too."""
        self.enabled = enabled
        self._jsonl = os.fdopen(open_private(run_dir / "metrics.jsonl"), "a") if enabled else None  # never a link
        self._tb = None
        self._wandb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if enabled and wandb is not None:
            self._wandb = _start_wandb(run_dir, **wandb)

    def write(self, step: int, record: dict[str, float | int | None]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self._jsonl.flush()
        scalars = {tag(k): v for k, v in record.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(run_dir: Path, project: str, mode: str, name: str, config: dict[str, Any]):
    try:
        import wandb
    except ImportError as exc:
        raise RuntimeError("train.wandb = true needs the wandb package: pip install 'megascale[wandb]'") from exc
    return wandb.init(project=project, name=name, mode=mode, dir=str(run_dir), config=config)


class StepClock:
    """ETA from the mean of the recent steps (the first ones include warm-up and compilation)."""

    def __init__(self, window: int = 20) -> None:
        self.recent: deque[float] = deque(maxlen=window)

    def eta_s(self, step_time: float, steps_left: int) -> float:
        self.recent.append(step_time)
        return steps_left * sum(self.recent) / len(self.recent)


def memory_record(device: torch.device) -> dict[str, float]:
    """Peak host RSS of this process so far and, on CUDA, this step's peak allocated and
    reserved memory (the peaks are reset, so the next step reports its own)."""
    out = {"mem_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if device.type == "cuda":
        out["mem_cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["mem_cuda_max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return out


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
    if "mem_cuda_max_allocated_gib" in rec:
        parts.append(f"mem {rec['mem_cuda_max_allocated_gib']:.1f}/{rec['mem_cuda_max_reserved_gib']:.1f} GiB")
    elif "mem_rss_peak_gib" in rec:
        parts.append(f"rss {rec['mem_rss_peak_gib']:.2f} GiB")
    if rec.get("eta_s") is not None:
        parts.append(f"eta {_duration(rec['eta_s'])}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
