"""Tensor-parallel overlap benchmark (issue 3): chunked collective GEMMs vs plain ones.

tp=2 ranks on this machine over gloo train the same sequence-parallel GPT with
`parallel.tp_overlap` off (one all-gather / reduce-scatter, waited for, then the GEMM) and on
(the GEMM cut into `--chunks` pieces pipelined against the collectives). The variants run
alternately in one process pair, step by step, so machine noise hits them alike. For every
step it reports the wall time of forward+backward and the *exposed* communication: the self
time of the `comm` timer spans (the waits on collectives), split by collective:

  tp.all_gather / tp.reduce_scatter  the ones fused into the GEMMs (what overlap can hide)
  tp.all_reduce                      embedding / loss reductions (vocab-parallel; not fused)
  tp.sp_grad_all_reduce              sequence-parallel LayerNorm/bias gradients (once a step)

    python bench/tp_overlap.py [--hidden 512 --seq 512 --batch 2 --layers 2 --steps 5]

Writes bench/results/tp_overlap.json.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from megascale.config.schema import JobConfig, ModelConfig, ParallelConfig
from megascale.diagnostics.timers import Timers, set_timers
from megascale.model.gpt import GPT
from megascale.parallel.mesh import init_mesh
from megascale.parallel.tensor import apply_tensor_parallel, sync_sequence_parallel_grads
from megascale.testing.launch import run_local

FUSED = ("tp.all_gather", "tp.reduce_scatter")


def variants(chunks: list[int]) -> dict[str, tuple[bool, int]]:
    out = {"off": (False, 1)}
    out.update({f"on-{c}": (True, c) for c in chunks})
    return out


def _rank(args: dict, out_dir: str) -> dict:
    torch.set_num_threads(args["threads"])
    mesh = init_mesh(ParallelConfig(tp=2), device="cpu")
    try:
        mcfg = ModelConfig(
            vocab_size=args["vocab"],
            seq_len=args["seq"],
            layers=args["layers"],
            hidden=args["hidden"],
            heads=args["heads"],
            block=args["block"],
        )
        torch.manual_seed(0)
        base = GPT(mcfg)
        models = {}
        for name, (overlap, chunks) in variants(args["chunks"]).items():
            cfg = JobConfig(
                model=mcfg,
                parallel=ParallelConfig(tp=2, sequence_parallel=True, tp_overlap=overlap, tp_overlap_chunks=chunks),
            )
            models[name] = copy.deepcopy(base)
            apply_tensor_parallel(models[name], cfg.parallel, mesh)
        del base
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, mcfg.vocab_size, (args["batch"], mcfg.seq_len), generator=g)
        labels = torch.randint(0, mcfg.vocab_size, (args["batch"], mcfg.seq_len), generator=g)
        timers = Timers(mesh.rank, {"tp": mesh.tp_rank}, None, out_dir, enabled=True)
        set_timers(timers)
        names = list(models)
        steps: dict[int, tuple[str, int, float]] = {}
        step_id = 0
        for it in range(args["warmup"] + args["steps"]):
            for name in names if it % 2 == 0 else names[::-1]:
                model = models[name]
                dist.barrier(group=mesh.tp_group)
                timers.end_step(-1)  # drop what came before: the step starts here
                start = time.perf_counter()
                loss = model(tokens, labels)
                (loss / labels.numel()).backward()
                sync_sequence_parallel_grads(model.parameters(), mesh.tp_group)
                wall = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                step_id += 1
                timers.end_step(step_id)
                steps[step_id] = (name, it, wall)
        timers.close()
        exposed: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for line in Path(timers.path).read_text().splitlines():
            rec = json.loads(line)
            if rec["kind"] == "comm" and rec["step"] in steps:
                exposed[rec["step"]][rec["name"]] += rec["self"]
        rows = []
        for sid, (name, it, wall) in steps.items():
            if it >= args["warmup"]:
                rows.append({"variant": name, "iter": it, "wall_s": wall, "exposed_s": dict(exposed[sid])})
        return {"rank": mesh.rank, "rows": rows}
    finally:
        mesh.destroy()


def summarise(per_rank: list[dict], names: list[str]) -> dict:
    """Per variant: medians over steps of the slower rank's wall time and exposed comm."""
    by_step: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in per_rank:
        for row in r["rows"]:
            by_step[(row["variant"], row["iter"])].append(row)
    out = {}
    for name in names:
        walls, fused, other = [], [], []
        for (variant, _), rows in sorted(by_step.items()):
            if variant != name:
                continue
            walls.append(max(row["wall_s"] for row in rows))
            fused.append(max(sum(v for k, v in row["exposed_s"].items() if k in FUSED) for row in rows))
            other.append(max(sum(v for k, v in row["exposed_s"].items() if k not in FUSED) for row in rows))
        out[name] = {
            "step_s": statistics.median(walls),
            "step_min_s": min(walls),
            "exposed_fused_comm_s": statistics.median(fused),
            "exposed_fused_comm_min_s": min(fused),
            "exposed_other_comm_s": statistics.median(other),
            "steps": len(walls),
        }
    base = out["off"]
    for rec in out.values():
        rec["step_ratio_vs_off"] = rec["step_s"] / base["step_s"]
        rec["fused_comm_ratio_vs_off"] = (
            rec["exposed_fused_comm_s"] / base["exposed_fused_comm_s"] if base["exposed_fused_comm_s"] else None
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--block", choices=("serial", "parallel"), default="parallel")
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--out", default="bench/results/tp_overlap.json")
    args = vars(p.parse_args())
    names = list(variants(args["chunks"]))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_local(_rank, 2, (args, tmp), timeout_s=3600, env={"OMP_NUM_THREADS": str(args["threads"])})
    summary = summarise(per_rank, names)
    print(
        f"tp=2 gloo, {args['block']} block, hidden {args['hidden']}, seq {args['seq']}, "
        f"batch {args['batch']}, layers {args['layers']}, {args['threads']} thread(s)/rank, "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("medians over steps (min in brackets) of the slower rank")
    print(f"{'variant':>8} {'step s':>16} {'vs off':>7} {'exposed AG/RS ms':>20} {'vs off':>7} {'other comm ms':>14}")
    for name in names:
        s = summary[name]
        ratio = s["fused_comm_ratio_vs_off"]
        step = f"{s['step_s']:.3f} ({s['step_min_s']:.3f})"
        comm = f"{1e3 * s['exposed_fused_comm_s']:.1f} ({1e3 * s['exposed_fused_comm_min_s']:.1f})"
        print(
            f"{name:>8} {step:>16} {s['step_ratio_vs_off']:7.3f} {comm:>20} "
            f"{'n/a' if ratio is None else f'{ratio:.3f}':>7} {1e3 * s['exposed_other_comm_s']:14.2f}"
        )
    result = {
        "benchmark": "tp_overlap",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "args": args,
        "summary": summary,
        "per_rank": per_rank,
    }
    Path(args["out"]).parent.mkdir(parents=True, exist_ok=True)
    Path(args["out"]).write_text(json.dumps(result, indent=1))
    print(f"wrote {args['out']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
