"""Long-context attention on CPU (issue 35): forward + backward time and peak tensor memory of
full causal attention (SDPA, its fused CPU flash kernel) against sliding-window attention at
w = 512 (the sliding-chunks kernel, `model/sliding_window.py`, what `train.attention=auto`
runs off CUDA), for sequence lengths 1k.. (8k by default; `--all`: up to 32k).

Both run side by side at each length, alternating, on the same inputs (batch 1, 8 query heads,
8 or `--kv-heads` key/value heads, head dim 64, fp32). Memory: the most bytes of tensors alive at
once that the call allocated beyond its inputs (`diagnostics.tensor_memory`), in one more run
after the timed ones (the tracker slows every op).
Goals: the SWA time grows linearly (ratio 32k/4k <= 10 at fixed w) and SWA is faster than full
from 2k on.

Then context parallelism: at the longest length the SWA layer's forward + backward with the
sequence whole on one process (cp = 1) and split over two gloo processes with the halo exchange
(cp = 2, `parallel/context.py`), and at `--ring-seq` (8k) full causal attention against ring
attention (`parallel/ring.py`), one thread per process: tokens/s (the sequence over the slowest
rank's time) and peak tensor memory per rank.

Last, what cp is for, in a whole model (`--parts model`): under a per-rank memory limit
(`--limit-mib`, `train.memory_limit_gib`) the longest sequence whose estimate fits one rank
(doubling from 2k) trains at cp = 1 and at cp = 2, and twice that sequence, which the estimate
refuses at cp = 1, trains at cp = 2. Each run is the real `Trainer` (SWA, the halo exchange,
one thread a rank): its tokens/s over the timed steps and the most tensor bytes a rank held from
building the Trainer through its first step (PyTorch's MemTracker, as `train.memory_limit_gib`'s
test measures it), against the limit.

    python bench/long_context.py [--all] [--window 512] [--repeats 2]
    python bench/long_context.py --parts ring --out bench/results/long_context_ring.json

Writes bench/results/long_context.json (the parts run; `--parts sweep,halo,ring,model` all).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from megascale.config import load_config
from megascale.diagnostics.tensor_memory import peak_tensor_bytes, wall_seconds
from megascale.model.attention import causal_attention
from megascale.parallel.context import ContextParallel
from megascale.testing.launch import run_local

RESULTS = Path(__file__).parent / "results" / "long_context.json"
DEFAULT_LENGTHS = [1024, 2048, 4096, 8192]
ALL_LENGTHS = [*DEFAULT_LENGTHS, 16384, 32768]
PARTS = ("sweep", "halo", "ring", "model")


def measure(seq: int, args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(seq)
    q = torch.randn(1, args.heads, seq, args.head_dim, generator=g).requires_grad_()
    k, v = (torch.randn(1, args.kv_heads, seq, args.head_dim, generator=g).requires_grad_() for _ in range(2))
    grad_out = torch.randn(q.shape, generator=g)
    windows = {"full": None, "swa": args.window}

    def step(window: int | None) -> None:
        q.grad = k.grad = v.grad = None
        causal_attention(q, k, v, window).backward(grad_out)

    row: dict = {"seq": seq, "full": {"seconds": []}, "swa": {"seconds": []}}
    step(args.window)  # warm-up (the mask cache)
    for r in range(args.repeats):  # untracked: the memory tracker costs µs per op, more for more ops
        for name, window in windows.items() if r % 2 == 0 else reversed(windows.items()):
            row[name]["seconds"].append(wall_seconds(lambda w=window: step(w)))
    for name, window in windows.items():
        row[name]["peak_bytes"] = peak_tensor_bytes(lambda w=window: step(w), external=(q, k, v, grad_out))
    for name in windows:
        row[name]["best_s"] = min(row[name]["seconds"])
    row["swa_vs_full_time"] = row["swa"]["best_s"] / row["full"]["best_s"]
    row["swa_vs_full_memory"] = row["swa"]["peak_bytes"] / row["full"]["peak_bytes"]
    print(
        f"{seq:>6}  full {row['full']['best_s']:8.3f} s {row['full']['peak_bytes'] / 2**20:8.1f} MiB   "
        f"swa {row['swa']['best_s']:8.3f} s {row['swa']['peak_bytes'] / 2**20:8.1f} MiB   "
        f"swa/full time {row['swa_vs_full_time']:.2f}",
        flush=True,
    )
    return row


def _cp_rank(seq: int, window: int | None, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    """One rank of the cp comparison (spawned by `run_local`: its environment, one thread);
    `window` None: full causal attention (ring attention under cp)."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        g = torch.Generator().manual_seed(rank)
        local = seq // size
        q = torch.randn(1, heads, local, head_dim, generator=g).requires_grad_()
        k, v = (torch.randn(1, kv_heads, local, head_dim, generator=g).requires_grad_() for _ in range(2))
        grad_out = torch.randn(q.shape, generator=g)
        context = ContextParallel(dist.group.WORLD, rank, size, ring=window is None)

        def step() -> None:
            q.grad = k.grad = v.grad = None
            context.attend(q, k, v, window).backward(grad_out)

        step()  # warm-up
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            seconds.append(wall_seconds(step))
        peak = peak_tensor_bytes(step, external=(q, k, v, grad_out))
        return {"rank": rank, "best_s": min(seconds), "peak_bytes": peak}
    finally:
        dist.destroy_process_group()


def measure_cp(seq: int, window: int | None, args: argparse.Namespace) -> dict:
    out: dict = {"seq": seq, "window": window}
    for size in (1, 2):
        ranks = run_local(
            _cp_rank,
            size,
            args=(seq, window, args.heads, args.kv_heads, args.head_dim, args.repeats),
            timeout_s=1800,
        )
        slowest = max(r["best_s"] for r in ranks)
        out[f"cp{size}"] = {
            "ranks": ranks,
            "tokens_per_s": seq / slowest,
            "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks),
        }
    out["cp2_vs_cp1_tokens_per_s"] = out["cp2"]["tokens_per_s"] / out["cp1"]["tokens_per_s"]
    out["cp2_vs_cp1_memory_per_rank"] = out["cp2"]["peak_bytes_per_rank"] / out["cp1"]["peak_bytes_per_rank"]
    kind = "ring attention" if window is None else f"halo, window {window}"
    print(
        f"cp at {seq} ({kind}): cp1 {out['cp1']['tokens_per_s']:.0f} tok/s "
        f"{out['cp1']['peak_bytes_per_rank'] / 2**20:.1f} MiB/rank; cp2 {out['cp2']['tokens_per_s']:.0f} tok/s "
        f"{out['cp2']['peak_bytes_per_rank'] / 2**20:.1f} MiB/rank",
        flush=True,
    )
    return out


def _model_overrides(args: argparse.Namespace, seq: int, cp: int, workdir: Path) -> list[str]:
    return [
        f"--model.seq_len={seq}",
        f"--model.layers={args.model_layers}",
        f"--model.hidden={args.model_hidden}",
        f"--model.heads={args.heads}",
        f"--model.window={args.window}",
        f"--parallel.cp={cp}",
        f"--train.memory_limit_gib={args.limit_mib / 1024}",
        f"--train.steps={1 + args.repeats}",
        "--train.global_batch=1",
        "--train.micro_batch=1",
        "--train.device='cpu'",
        "--train.eval_every=0",
        "--train.tensorboard=false",
        "--checkpoint.every=0",
        "--optim.warmup_steps=0",
        f"--train.run_dir='{workdir / f'run-{seq}-cp{cp}'}'",
        f"--data.cache_dir='{workdir / 'cache'}'",
    ]


def _trainer_rank(overrides: list[str], repeats: int) -> dict:
    """One rank of a whole-model run (spawned by `run_local`): its tensor peak over building the
    Trainer and its first step, then the step times of `repeats` more steps."""
    from megascale.train.trainer import Trainer

    cfg = load_config(None, overrides)
    built: list[Trainer] = []

    def build_and_step() -> None:
        built.append(Trainer(cfg))
        built[0].run_step()

    peak = peak_tensor_bytes(build_and_step)
    try:
        seconds = [built[0].run_step()["step_time"] for _ in range(repeats)]
    finally:
        built[0].close()
    return {"rank": int(os.environ["RANK"]), "peak_bytes": peak, "step_s": seconds}


def measure_model(args: argparse.Namespace) -> dict:
    """The longest sequence one rank fits under the limit, at cp 1 and 2; twice it at cp 2."""
    from megascale.plan.memory import job_memory_estimate

    limit = args.limit_mib * 2**20
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        workdir = Path(tmp)

        def estimate(seq: int, cp: int) -> float:
            return job_memory_estimate(load_config(None, _model_overrides(args, seq, cp, workdir)), "cpu").total

        longest = 2048
        while estimate(2 * longest, 1) <= limit:
            longest *= 2
        if estimate(longest, 1) > limit:
            raise SystemExit(f"--limit-mib {args.limit_mib}: not even {longest} tokens fit one rank")
        runs = []
        for seq, cp in ((longest, 1), (longest, 2), (2 * longest, 2)):
            ranks = run_local(
                _trainer_rank, cp, (_model_overrides(args, seq, cp, workdir), args.repeats), timeout_s=3600
            )
            step_s = min(max(r["step_s"][i] for r in ranks) for i in range(args.repeats))  # best step, slowest rank
            run = {
                "seq": seq,
                "cp": cp,
                "fits_one_rank_by_estimate": estimate(seq, 1) <= limit,
                "estimate_bytes_per_rank": estimate(seq, cp),
                "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks),
                "tokens_per_s": seq / step_s,
                "ranks": ranks,
            }
            run["within_limit"] = run["peak_bytes_per_rank"] <= limit
            runs.append(run)
            print(
                f"model at {seq} tokens, cp{cp}: {run['tokens_per_s']:.0f} tok/s, "
                f"{run['peak_bytes_per_rank'] / 2**20:.1f} MiB/rank "
                f"(estimate {run['estimate_bytes_per_rank'] / 2**20:.1f}, limit {args.limit_mib:g})",
                flush=True,
            )
    return {
        "limit_mib": args.limit_mib,
        "model": {"layers": args.model_layers, "hidden": args.model_hidden, "heads": args.heads, "window": args.window},
        "longest_on_one_rank": longest,
        "runs": runs,
        "cp2_vs_cp1_tokens_per_s_same_seq": runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"],
        "cp2_vs_cp1_memory_per_rank_same_seq": runs[1]["peak_bytes_per_rank"] / runs[0]["peak_bytes_per_rank"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="lengths up to 32k (full attention there takes minutes)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per variant and length (best kept)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ring-seq", type=int, default=8192, help="length of the ring attention comparison")
    ap.add_argument("--parts", default="sweep,halo,ring", help=f"which of {','.join(PARTS)} to run")
    ap.add_argument("--limit-mib", type=float, default=48.0, help="the model part's per-rank memory limit")
    ap.add_argument("--model-layers", type=int, default=2)
    ap.add_argument("--model-hidden", type=int, default=64)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--parts {args.parts}: each must be one of {', '.join(PARTS)}")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    lengths = ALL_LENGTHS if args.all else DEFAULT_LENGTHS
    result = {
        "benchmark": "long_context",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "note": "CPU, fp32, the machine shared with other jobs (see the load average): times are noisy; "
        "full and SWA are timed side by side at each length; cp: one thread per rank, gloo on loopback",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    if "sweep" in parts:
        result |= sweep(lengths, args)
    if "halo" in parts:
        result["context_parallel"] = measure_cp(max(lengths), args.window, args)
    if "ring" in parts:
        result["ring_attention"] = measure_cp(args.ring_seq, None, args)
    if "model" in parts:
        result["model_under_a_memory_limit"] = measure_model(args)
    result["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def sweep(lengths: list[int], args: argparse.Namespace) -> dict:
    """Full against SWA at every length, and the summary against the goals."""
    rows = [measure(seq, args) for seq in lengths]
    by_seq = {r["seq"]: r for r in rows}
    longest = max(by_seq)
    summary = {
        "swa_time_ratio_longest_vs_4k": by_seq[longest]["swa"]["best_s"] / by_seq[4096]["swa"]["best_s"],
        "longest": longest,
        "linear_ratio_would_be": longest / 4096,
        "swa_faster_than_full_from": next(
            (r["seq"] for r in rows if all(s["swa_vs_full_time"] < 1 for s in rows if s["seq"] >= r["seq"])), None
        ),
        "goal": "swa time ratio 32k/4k <= 10; swa faster than full from 2048 on",
    }
    print(summary)
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    raise SystemExit(main())
