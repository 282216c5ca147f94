"""Precision benchmarks (issue 28), one independent part per `--part`, each writing its own key
of bench/results/precision.json (the other parts' keys are kept as they are).

- `gap`: the loss gap of bf16 training (autocast compute, bf16 parameters, fp32 master weights
  and optimizer state) against fp32, on the same data and seed, over `--steps` (500) steps of a
  small model, one process. Key "loss_gap".

    python bench/precision.py --part gap [--steps 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megascale.config import default_config_path, load_config
from megascale.train.trainer import Trainer

RESULTS = Path(__file__).parent / "results" / "precision.json"
MODEL = ["--model.layers=2", "--model.hidden=64", "--model.heads=4", "--model.seq_len=64", "--model.window=32"]
BF16 = ["--train.dtype=bf16", "--train.param_dtype=bf16"]


def _train(root: Path, name: str, steps: int, extra: list[str]) -> tuple[list[float], float]:
    cfg = load_config(default_config_path(), [
        *MODEL, f"--train.steps={steps}", "--train.global_batch=8", "--train.micro_batch=4", "--train.device=cpu",
        "--train.eval_every=0", "--train.log_every=100", "--train.tensorboard=false", "--checkpoint.every=0",
        "--checkpoint.resume=none", f"--train.run_dir={root / name}", f"--data.cache_dir={root / 'corpus'}",
        *extra])
    trainer = Trainer(cfg)
    start = time.perf_counter()
    try:
        losses = trainer.fit()
    finally:
        trainer.close()
    return losses, time.perf_counter() - start


def loss_gap(steps: int) -> dict:
    """fp32 and bf16 runs side by side; the gap of the mean loss over windows of 50 steps."""
    with tempfile.TemporaryDirectory() as tmp:
        fp32, fp32_s = _train(Path(tmp), "fp32", steps, [])
        bf16, bf16_s = _train(Path(tmp), "bf16", steps, BF16)
    window = 50
    windows = []
    for start in range(0, steps - window + 1, window):
        a, b = statistics.mean(fp32[start:start + window]), statistics.mean(bf16[start:start + window])
        windows.append({"steps": [start + 1, start + window], "fp32": round(a, 5), "bf16": round(b, 5),
                        "gap_rel": round((b - a) / a, 6)})
    return {
        "what": "mean loss of bf16 training (autocast + bf16 parameters, fp32 masters and optimizer state) "
                "against fp32, same data and seed, one process, LAMB lr 2e-3 (the built-in defaults)",
        "model": " ".join(MODEL), "steps": steps, "first_loss": round(fp32[0], 5),
        "last_window": windows[-1], "max_abs_gap_rel": max(abs(w["gap_rel"]) for w in windows),
        "windows": windows, "seconds": {"fp32": round(fp32_s, 1), "bf16": round(bf16_s, 1)},
        "note": "2-core CPU shared with other jobs (loaded): the seconds are noisy and CPU bf16 is emulated; "
                "the loss figures do not depend on load",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }


PARTS: dict[str, tuple[str, Callable[[argparse.Namespace], dict]]] = {
    "gap": ("loss_gap", lambda args: loss_gap(args.steps)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=sorted(PARTS), required=True)
    parser.add_argument("--steps", type=int, default=500, help="gap: training steps of each run")
    args = parser.parse_args()
    key, run = PARTS[args.part]
    result = run(args)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = result
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps({key: {k: v for k, v in result.items() if k != "windows"}}, indent=2))


if __name__ == "__main__":
    main()
