"""Model build per rank: host memory and time until a rank holds its initialised parameters.

`eager` is how ranks built the model before: the whole model on the host, then cut to the
rank's tensor-parallel slice and pipeline stage. `meta` is how the trainer builds it now: on
the meta device, cut, then only the rank's part computed (`megascale.parallel.materialize`).
Each (mode, layout) runs in a fresh process as tp rank 0 / pp rank 0, so its peak RSS is its own.
Both modes must give identical local values (a checksum is compared).

    python bench/init_memory.py [--layers 24 --hidden 2048]   # ~1.4B parameters, ~6 GB fp32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = [(1, 1), (2, 2), (8, 4)]  # (tp, pp)


def child(mode: str, tp: int, pp: int, layers: int, hidden: int) -> dict:
    import torch

    from megascale.config import ModelConfig
    from megascale.model import GPT
    from megascale.model.init import SeededValues
    from megascale.parallel.materialize import materialize
    from megascale.parallel.pipeline import split_model
    from megascale.parallel.tensor import parallelize
    from megascale.parallel.tp_comm import TPContext

    cfg = ModelConfig(vocab_size=50304, seq_len=2048, layers=layers, hidden=hidden, heads=hidden // 128)
    base_rss = _max_rss_gib()
    start = time.perf_counter()
    if mode == "eager":
        model = GPT(cfg, seed=0)
    else:
        with torch.device("meta"):
            model = GPT(cfg)
    if tp > 1:
        parallelize(model, TPContext(group=None, rank=0, size=tp, sequence_parallel=True))
    chunks = split_model(model, pp, 1, 0) if pp > 1 else [model]
    if mode == "meta":
        materialize(chunks, SeededValues(cfg, 0), torch.device("cpu"))
    del model  # eager: what the rank does not hold is freed here
    seconds = time.perf_counter() - start
    params = [p for c in chunks for p in c.parameters()]
    return {
        "seconds": seconds,
        "peak_rss_growth_gib": _max_rss_gib() - base_rss,
        "local_params_m": sum(p.numel() for p in params) / 1e6,
        "checksum": sum(float(p.double().sum()) for p in params),
    }


def _max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "TP", "PP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, tp, pp = args.child[0], int(args.child[1]), int(args.child[2])
        print(json.dumps(child(mode, tp, pp, args.layers, args.hidden)))
        return
    rows = []
    for tp, pp in LAYOUTS:
        row: dict = {"tp": tp, "pp": pp}
        for mode in ("eager", "meta"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--layers",
                    str(args.layers),
                    "--hidden",
                    str(args.hidden),
                    "--child",
                    mode,
                    str(tp),
                    str(pp),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            row[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        row["values_equal"] = row["eager"]["checksum"] == row["meta"]["checksum"]
        row["memory_ratio"] = row["eager"]["peak_rss_growth_gib"] / max(row["meta"]["peak_rss_growth_gib"], 1e-9)
        row["time_ratio"] = row["eager"]["seconds"] / row["meta"]["seconds"]
        rows.append(row)
        e, m = row["eager"], row["meta"]
        print(
            f"tp={tp} pp={pp}: local {m['local_params_m']:.0f}M params | "
            f"eager {e['seconds']:.1f} s, +{e['peak_rss_growth_gib']:.2f} GiB | "
            f"meta {m['seconds']:.1f} s, +{m['peak_rss_growth_gib']:.2f} GiB | memory x{row['memory_ratio']:.1f}, "
            f"time x{row['time_ratio']:.1f}, values equal: {row['values_equal']}",
            flush=True,
        )
    out_dir = Path(os.environ.get("OUT") or "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "init_memory.json"
    path.write_text(
        json.dumps({"layers": args.layers, "hidden": args.hidden, "threads": os.cpu_count(), "rows": rows}, indent=2)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
