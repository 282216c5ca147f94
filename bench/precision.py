"""Precision benchmarks (issue 28), one part per run; each writes its own key of
bench/results/precision.json and leaves the others' as they are.

`--part loss` (key "chunked_loss"): peak tensor memory and time of the head's loss forward +
backward, whole logits (the plain projection + fp32 cross-entropy the head ran before) against
the chunked loss (`model/loss.py`), at vocabulary 128k and a 4k-token sequence by default.
Both variants run side by side in one process, alternating, on the same inputs; their losses and
gradients are compared too. Memory: the most bytes of tensors alive at once that the loss
allocated (`diagnostics.tensor_memory`, PyTorch's MemTracker; the inputs and the weight
existed before, the gradients it returns are counted), in a run of its own so the tracker does
not slow the timed runs. Goal: chunked <= 0.2x the memory, <= 1.05x the time.

    python bench/precision.py --part loss [--vocab 128256] [--seq 4096] [--hidden 256] \
        [--chunk 1024] [--repeats 3]

`--part gap` (key "loss_gap"): the loss gap of bf16 training (autocast compute, bf16 parameters, fp32 master weights
and optimizer state) against fp32, on the same data and seed, over `--steps` (500) steps of a
small model, one process.

    python bench/precision.py --part gap [--steps 500]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megascale.config import default_config_path, load_config
from megascale.diagnostics.tensor_memory import peak_tensor_bytes, wall_seconds
from megascale.model.loss import chunked_cross_entropy
from megascale.train.trainer import Trainer

RESULTS = Path(__file__).parent / "results" / "precision.json"


def _whole(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    return F.cross_entropy(F.linear(x, w).float(), labels, reduction="sum")


def _chunked(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    return chunked_cross_entropy(x, w, labels, chunk)


def loss_part(args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = args.batch * args.seq
    x = torch.randn(tokens, args.hidden, generator=g).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (tokens,), generator=g)
    variants = {"whole": _whole, "chunked": _chunked}

    def step(fn) -> torch.Tensor:
        x.grad = w.grad = None
        loss = fn(x, w, labels, args.chunk)
        loss.backward()
        return loss.detach()

    results = {name: {"seconds": [], "peak_bytes": 0} for name in variants}
    outputs = {}
    for name, fn in variants.items():  # memory runs (tracked), also warm-up; keep the outputs
        results[name]["peak_bytes"] = peak_tensor_bytes(lambda fn=fn: step(fn))
        outputs[name] = (step(fn), x.grad.clone(), w.grad.clone())
        print(f"{name:>8}: peak {results[name]['peak_bytes'] / 2**30:.2f} GiB", flush=True)
    for r in range(args.repeats):
        for name, fn in variants.items() if r % 2 == 0 else reversed(variants.items()):
            seconds = wall_seconds(lambda fn=fn: step(fn))
            results[name]["seconds"].append(seconds)
            print(f"{name:>8}: {seconds:.2f} s", flush=True)
    x.grad = w.grad = None
    diffs = {
        label: float((a - b).abs().max() / b.abs().max())
        for label, a, b in zip(("loss", "grad_x", "grad_w"), outputs["chunked"], outputs["whole"], strict=True)
    }
    whole, chunked = results["whole"], results["chunked"]
    for r in results.values():
        r["median_s"] = statistics.median(r["seconds"])
    summary = {
        "memory_ratio": chunked["peak_bytes"] / whole["peak_bytes"],
        "time_ratio": chunked["median_s"] / whole["median_s"],
        "goal": {"memory_ratio": 0.2, "time_ratio": 1.05},
        "max_relative_difference": diffs,
        "whole_logits_bytes": tokens * args.vocab * 4,
    }
    print(
        f"chunked/whole: memory {summary['memory_ratio']:.3f}x, time {summary['time_ratio']:.3f}x; "
        f"relative differences {diffs}"
    )
    return {"variants": results, "summary": summary}


MODEL = ["--model.layers=2", "--model.hidden=64", "--model.heads=4", "--model.seq_len=64", "--model.window=32"]
BF16 = ["--train.dtype=bf16", "--train.param_dtype=bf16"]


def _train(root: Path, name: str, steps: int, extra: list[str]) -> tuple[list[float], float]:
    cfg = load_config(
        default_config_path(),
        [
            *MODEL,
            f"--train.steps={steps}",
            "--train.global_batch=8",
            "--train.micro_batch=4",
            "--train.device=cpu",
            "--train.eval_every=0",
            "--train.log_every=100",
            "--train.tensorboard=false",
            "--checkpoint.every=0",
            "--checkpoint.resume=none",
            f"--train.run_dir={root / name}",
            f"--data.cache_dir={root / 'corpus'}",
            *extra,
        ],
    )
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
        a, b = statistics.mean(fp32[start : start + window]), statistics.mean(bf16[start : start + window])
        windows.append(
            {
                "steps": [start + 1, start + window],
                "fp32": round(a, 5),
                "bf16": round(b, 5),
                "gap_rel": round((b - a) / a, 6),
            }
        )
    return {
        "what": "mean loss of bf16 training (autocast + bf16 parameters, fp32 masters and optimizer state) "
        "against fp32, same data and seed, one process, LAMB lr 2e-3 (the built-in defaults)",
        "model": " ".join(MODEL),
        "steps": steps,
        "first_loss": round(fp32[0], 5),
        "last_window": windows[-1],
        "max_abs_gap_rel": max(abs(w["gap_rel"]) for w in windows),
        "windows": windows,
        "seconds": {"fp32": round(fp32_s, 1), "bf16": round(bf16_s, 1)},
        "note": "2-core CPU shared with other jobs (loaded): the seconds are noisy and CPU bf16 is emulated; "
        "the loss figures do not depend on load",
    }


PARTS = {"loss": ("chunked_loss", loss_part), "gap": ("loss_gap", lambda args: loss_gap(args.steps))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256, help="the head's input width (the GEMMs' inner dim)")
    ap.add_argument("--chunk", type=int, default=1024, help="train.loss_chunk")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=500, help="gap: training steps of each run")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    key, run = PARTS[args.part]
    load_before = os.getloadavg()[0]
    result = run(args)
    result.setdefault(
        "note",
        "CPU, fp32; the machine was shared with other jobs (see the load average): times are "
        "noisy, the ratio is of runs taken side by side",
    )
    result.update(
        {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
    )
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    existing[key] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(existing, indent=1) + "\n")
    print(f"wrote {args.out} [{key}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
