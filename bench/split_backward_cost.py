"""Compute cost of the split backward (zero-bubble schedules) in one process: one pipeline stage
of the p = 2 bubble benchmark's model, F + fused backward against F + B + W (W right after B),
alternating run by run, one thread. Separates what splitting costs from what a pipeline run adds
(docs/pipeline.md, "Idle machine").

    python bench/split_backward_cost.py [--hidden 512] [--runs 12] [--out bench/results/split_backward_cost.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from megascale.config import ModelConfig
from megascale.model import GPT
from megascale.parallel import weight_grad
from megascale.parallel.pipeline import split_model

WARMUP = 2  # runs not kept (allocator, first-touch)


def stage_times(cfg: ModelConfig, stage: int, runs: int) -> dict[str, float]:
    """Median ms of F and the backward (fused), and of F, B and W (split), for `stage` of 2."""
    torch.manual_seed(0)
    fused = split_model(GPT(cfg), 2, 1, stage, "even", False)[0]
    split = split_model(GPT(cfg), 2, 1, stage, "even", False)[0]
    weight_grad.split_backward(split)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
    hidden = torch.randn(4, cfg.seq_len, cfg.hidden)
    times: dict[str, list[float]] = {k: [] for k in ("fused_F", "fused_B", "split_F", "split_B", "split_W")}

    def one(chunk: torch.nn.Module, split_run: bool) -> list[float]:
        """F, backward (B when split) and, when split, W: seconds each."""
        work: list = []
        x = tokens if stage == 0 else hidden.clone().requires_grad_()
        with weight_grad.deferring(work) if split_run else contextlib.nullcontext():
            marks = [time.perf_counter()]  # F and B build and defer, as the runtime's B action does
            out = chunk(x, labels) if stage == 1 else chunk(x)
            marks.append(time.perf_counter())
            torch.autograd.backward(out, None if stage == 1 else torch.ones_like(out))
            marks.append(time.perf_counter())
        if split_run:
            weight_grad.run(work)
            marks.append(time.perf_counter())
        chunk.zero_grad(set_to_none=True)
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    for run in range(runs + WARMUP):
        for mode in ("fused", "split") if run % 2 else ("split", "fused"):
            spans = one(split if mode == "split" else fused, mode == "split")
            if run >= WARMUP:
                for name, span in zip([k for k in times if k.startswith(mode)], spans, strict=True):
                    times[name].append(span)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default="bench/results/split_backward_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, seq_len=128, layers=8, hidden=args.hidden, heads=8, positions="learned")
    report: dict = {"config": vars(args), "torch": torch.__version__, "stages": {}}
    for stage in (0, 1):
        t = stage_times(cfg, stage, args.runs)
        fused, split = t["fused_F"] + t["fused_B"], t["split_F"] + t["split_B"] + t["split_W"]
        report["stages"][stage] = {**t, "fused_ms": fused, "split_ms": split, "split_over_fused": split / fused}
        print(
            f"stage {stage}: fused F {t['fused_F']:.1f} + backward {t['fused_B']:.1f} = {fused:.1f} ms | "
            f"split F {t['split_F']:.1f} + B {t['split_B']:.1f} + W {t['split_W']:.1f} = {split:.1f} ms "
            f"(split/fused {split / fused:.3f}; medians of {args.runs})"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
