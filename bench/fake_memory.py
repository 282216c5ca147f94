"""One rank's memory at large layouts, measured in fake mode, against the planner (issue 32).

Each layout is built as `megascale train` builds rank 0 (`megascale/testing/fake_memory.py`:
the real model, tensor/pipeline split, ZeRO-2 buffers and optimizer under `FakeTensorMode`, the
mesh on torch's fake process group) and compared per category with `job_memory_estimate`, the
planner's memory model for the same job. bf16 parameters and compute, micro-batch 1, even
pipeline split (the planner assumes even stages; `--split auto` measures the trainer's default).
Writes bench/results/fake_memory.json.

    OMP_NUM_THREADS=1 python bench/fake_memory.py [--only llama-3-8b] [--split even|auto]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from megascale.config import load_config
from megascale.testing.fake_memory import compare_with_plan

ROOT = Path(__file__).resolve().parents[1]
# (name, config, tp, pp, dp): an 8B and a 7B shape at tp8 pp4; MegaScale's 175B and 530B layouts (6.1)
LAYOUTS = (
    ("llama-3-8b", "configs/llama-3-8b.toml", 8, 4, 8),
    ("mistral-7b", "configs/mistral-7b.toml", 8, 4, 8),
    ("gpt-175b", "configs/gpt-175b.toml", 8, 8, 192),
    ("gpt-530b", "configs/gpt-530b.toml", 8, 35, 40),
)


def job(config: str, tp: int, pp: int, dp: int, split: str):
    return load_config(
        ROOT / config,
        overrides=[
            f"--parallel.tp={tp}",
            f"--parallel.pp={pp}",
            f"--parallel.dp={dp}",
            "--parallel.vpp=1",
            f"--parallel.pp_split={split}",
            "--train.param_dtype=bf16",
            "--train.dtype=bf16",
            "--train.micro_batch=1",
            f"--train.global_batch={dp * pp}",
            "--train.recompute=none",
        ],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="layouts whose name starts with this")
    parser.add_argument("--split", default="even", choices=("even", "auto"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fake_memory.json"))
    args = parser.parse_args()
    rows = []
    for name, config, tp, pp, dp in LAYOUTS:
        if args.only and not name.startswith(args.only):
            continue
        start = time.perf_counter()
        cmp = compare_with_plan(job(config, tp, pp, dp, args.split))
        seconds = time.perf_counter() - start
        rows.append(
            {
                "model": name,
                "layout": f"tp{tp} pp{pp} dp{dp}",
                "world": tp * pp * dp,
                "seconds": round(seconds, 1),
                "gib": {
                    k: {
                        "measured": round(v["measured"] / 2**30, 3),
                        "planned": round(v["planned"] / 2**30, 3),
                        "ratio": round(v["ratio"], 3),
                    }
                    for k, v in cmp.items()
                },
            }
        )
        cells = "  ".join(
            f"{k} {v['measured'] / 2**30:.2f}/{v['planned'] / 2**30:.2f} GiB (x{v['ratio']:.2f})"
            for k, v in cmp.items()
        )
        print(f"{name} tp{tp} pp{pp} dp{dp} ({seconds:.1f} s): measured/planned  {cells}", flush=True)
    if not args.only:
        Path(args.out).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "split": args.split,
                    "note": "fake mode: shapes only, no memory used; rank 0 (first stage); activations "
                    "per micro-batch (planner's divided by its in-flight count); machine loaded "
                    f"(load average {os.getloadavg()[0]:.0f}), which only affects the seconds",
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
