"""Measured pipeline bubble vs theory, and exposed send/recv time with and without decoupling.

One run spawns `p` gloo ranks (one thread each) and trains the same GPT with four runners,
alternating step by step so machine noise hits all alike:
  v=1 and v=2 (plain and interleaved 1F1B, same p and m), each with decoupled sends (the
  default: isend, waited lazily) and coupled sends (each send waited before going on).
Every action is timed by the runner itself (`pp.forward`/`pp.backward` compute spans, `pp.recv`
/`pp.send`/`pp.send_wait` p2p spans, read back from the per-rank timer files). A step's window
runs from a common start (after a barrier) to the moment the last rank finishes; a rank's idle
time is the window minus its compute, and its bubble is idle / compute, which theory puts at
(p-1)/(v*m). The model is sized so that compute dominates (wide layers, a tiny vocabulary, so
the embedding and head add little imbalance). Target: measured within 2 points of theory.
Figures are medians over the measured steps, plus the bubble of each mode's fastest step (noise
only adds time), plus a replay: the schedule simulated with the step's measured compute times
and ideal links, which separates stage imbalance (in the replay) from runtime overhead (the
difference between measured and replay).

    python bench/pipeline_bubble.py [--p 4] [--m 8] [--hidden 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
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

from megascale.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
from megascale.data import TokenBatch
from megascale.diagnostics.timers import Timers, set_timers
from megascale.model import GPT
from megascale.parallel import init_mesh
from megascale.parallel.pipeline import PipelineRunner, build_schedule, simulate, split_model
from megascale.parallel.pipeline.schedule import Op
from megascale.testing.launch import run_local

MODES = [(1, True), (2, True), (1, False), (2, False)]  # (v, decoupled)


def job(args, v: int) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(vocab_size=64, seq_len=args.seq, layers=args.layers, hidden=args.hidden,
                          heads=8, positions="learned"),
        parallel=ParallelConfig(pp=args.p, vpp=v),
        train=TrainConfig(micro_batch=args.micro_batch, global_batch=args.micro_batch * args.m,
                          device="cpu"),
    )
    cfg.validate()
    return cfg


def physical_cores() -> list[int]:
    """One logical CPU per physical core this process may run on (hyper-thread siblings share
    a core's arithmetic units, which would make two stages' compute times differ)."""
    seen, cpus = set(), []
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topo / "physical_package_id").read_text(), (topo / "core_id").read_text())
        except OSError:
            key = (str(cpu), "")
        if key not in seen:
            seen.add(key)
            cpus.append(cpu)
    return cpus


def gemm_seconds(size: int = 384, reps: int = 40) -> float:
    """Time of a fixed GEMM loop on this rank's core (the stages' kind of work)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return time.perf_counter() - start


def contention(mesh) -> dict[str, float]:
    """The same GEMM loop with this rank computing alone, then with every rank at once. Pipeline
    stages compute at the same time in the steady phase and alone in warm-up/cool-down; when the
    cores share resources (hyper-threads of one physical core, memory bandwidth), compute time
    depends on that overlap, and idle/compute no longer measures only the schedule."""
    gemm_seconds(reps=5)  # warm-up
    alone = 0.0
    for r in range(mesh.world_size):
        dist.barrier()
        if r == mesh.rank:
            alone = min(gemm_seconds() for _ in range(3))
        dist.barrier()
    together = []
    for _ in range(3):
        dist.barrier()
        together.append(gemm_seconds())
    return {"alone_s": alone, "together_s": min(together), "slowdown": min(together) / alone}


def rank_main(args, out_dir: str) -> dict:
    torch.set_num_threads(1)
    cores = physical_cores()
    if args.pin and len(cores) >= args.p:  # each stage on its own core: even stage times
        os.sched_setaffinity(0, {cores[int(os.environ["RANK"])]})
    mesh = init_mesh(ParallelConfig(pp=args.p), device="cpu")
    timers = Timers(mesh.rank, mesh.coords._asdict(), "bench", out_dir, enabled=True)
    set_timers(timers)
    try:
        shared = contention(mesh)
        runners = {}
        for v, decoupled in MODES:
            cfg = job(args, v)
            torch.manual_seed(0)
            chunks = split_model(GPT(cfg.model), args.p, v, mesh.pp_rank, cfg.parallel.pp_split)
            runners[(v, decoupled)] = PipelineRunner(chunks, cfg, mesh, decoupled=decoupled)
        g = torch.Generator().manual_seed(1)
        shape = (args.m, args.micro_batch, args.seq)
        batch = TokenBatch(torch.randint(0, 64, shape, generator=g),
                           torch.randint(0, 64, shape, generator=g))
        tokens = batch.labels.numel()
        windows: dict[int, tuple[str, float]] = {}
        step = 0
        for rnd in range(args.rounds + 1):  # round 0 warms up (shapes, allocator, gloo pairs)
            order = MODES if rnd % 2 else MODES[::-1]
            for v, decoupled in order:
                runner = runners[(v, decoupled)]
                dist.barrier()
                timers.end_step(step)  # flush what came before; the step's spans start here
                step += 1
                start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for all processes
                runner.forward_backward(batch, tokens)
                span = torch.tensor([-start, time.perf_counter()], dtype=torch.float64)
                dist.all_reduce(span, op=dist.ReduceOp.MAX)
                runner.zero_grad()
                if rnd > 0:
                    windows[step] = (f"v={v} {'decoupled' if decoupled else 'coupled'}",
                                     float(span[0] + span[1]))
        timers.end_step(step)
        return {"rank": mesh.rank, "windows": windows, "contention": shared}
    finally:
        timers.close()
        mesh.destroy()


def collect(out_dir: Path, results: list[dict], args) -> dict:
    """Per mode and rank (medians over the measured steps): compute, idle, measured bubble,
    the bubble the schedule predicts when replayed with this step's measured compute times
    and ideal links, and the time spent in receive waits and sends."""
    table: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(
        lambda: defaultdict(list)))
    steps: dict[int, dict[int, dict]] = defaultdict(dict)  # step -> rank -> per-step figures
    modes: dict[int, str] = {}
    for res in results:
        rank = res["rank"]
        per_step: dict[int, dict] = defaultdict(lambda: defaultdict(float))
        for line in (out_dir / "timers" / f"rank{rank:05d}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            name, s = rec["name"], per_step[rec["step"]]
            if name in ("pp.forward", "pp.backward"):
                s["compute"] += rec["self"]
                op = Op.FORWARD if name == "pp.forward" else Op.BACKWARD
                s.setdefault("times", {})[(op, rec["attrs"]["mb"], rec["attrs"]["chunk"])] = \
                    rec["dur"]
            elif name == "pp.recv":
                s["recv"] += rec["self"]
            elif name in ("pp.send", "pp.send_wait"):  # not pp.send_drain: nothing left to do
                s["send"] += rec["self"]
        for step, (mode, window) in res["windows"].items():
            steps[step][rank] = dict(per_step[step], window=window)
            modes[step] = mode
    for step, ranks in steps.items():
        mode = modes[step]
        v = int(mode.split()[0][2:])
        replay = simulate(build_schedule("1f1b", args.p, v, args.m),
                          duration=lambda r, a, ranks=ranks: ranks[r]["times"][(a.op, a.mb,
                                                                                a.chunk)])
        for rank, s in ranks.items():
            row = table[mode][rank]
            row["window"].append(s["window"])
            row["compute"].append(s["compute"])
            row["idle"].append(s["window"] - s["compute"])
            row["bubble"].append((s["window"] - s["compute"]) / s["compute"])
            row["replay_bubble"].append(replay.idle[rank] / replay.busy[rank])
            row["recv"].append(s["recv"])
            row["send"].append(s["send"])
    out: dict[str, dict[int, dict[str, float]]] = {}
    for mode, ranks in table.items():
        out[mode] = {}
        for rank, row in sorted(ranks.items()):
            fastest = min(range(len(row["window"])), key=row["window"].__getitem__)
            out[mode][rank] = {k: statistics.median(v) for k, v in row.items()}
            # noise only adds time: the fastest step is the least disturbed one
            out[mode][rank]["fastest_bubble"] = row["bubble"][fastest]
            out[mode][rank]["fastest_replay_bubble"] = row["replay_bubble"][fastest]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin each rank to its own physical core (pinned when enough)")
    ap.add_argument("--out", default="bench/results/pipeline_bubble.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        results = run_local(rank_main, args.p, (args, tmp), timeout_s=1800)
        stats = collect(Path(tmp), results, args)

    report = {"config": vars(args), "torch": torch.__version__, "host": platform.node(),
              "cpus": os.cpu_count(), "modes": {},
              "contention": {r["rank"]: r["contention"] for r in results}}
    slow = statistics.mean(r["contention"]["slowdown"] for r in results)
    print(f"compute contention: the same GEMM loop takes {slow:.2f}x as long with every rank computing "
          "as with one rank alone (1.00: independent cores)")
    print(f"p={args.p} m={args.m}: bubble = idle / compute per rank (median of {args.rounds}); "
          "replay = the schedule played with the measured compute times and ideal links")
    print(f"{'mode':<14} {'rank':>4} {'compute s':>9} {'idle s':>7} {'bubble':>7} {'replay':>7} "
          f"{'fastest':>7} {'theory':>7} {'recv ms':>8} {'send ms':>8} {'step s':>7}")
    for mode, ranks in stats.items():
        v = int(mode.split()[0][2:])
        theory = (args.p - 1) / (v * args.m)
        for rank, s in ranks.items():
            print(f"{mode:<14} {rank:>4} {s['compute']:9.3f} {s['idle']:7.3f} {s['bubble']:7.1%} "
                  f"{s['replay_bubble']:7.1%} {s['fastest_bubble']:7.1%} {theory:7.1%} "
                  f"{1e3 * s['recv']:8.1f} "
                  f"{1e3 * s['send']:8.1f} {s['window']:7.3f}")
        mean = {k: statistics.mean(s[k] for s in ranks.values())
                for k in ("bubble", "replay_bubble", "fastest_bubble", "window")}
        report["modes"][mode] = {
            "theory": theory, "bubble_mean": mean["bubble"],
            "replay_bubble_mean": mean["replay_bubble"],
            "fastest_step_bubble_mean": mean["fastest_bubble"],
            "fastest_gap_to_theory_points": 100 * (mean["fastest_bubble"] - theory),
            "gap_to_theory_points": 100 * (mean["bubble"] - theory),
            "runtime_overhead_points": 100 * (mean["bubble"] - mean["replay_bubble"]),
            "step_s": mean["window"],
            "send_blocked_s": sum(s["send"] for s in ranks.values()),
            "recv_wait_s": sum(s["recv"] for s in ranks.values()),
            "ranks": ranks,
        }
    print()
    for v in (1, 2):
        d, c = report["modes"][f"v={v} decoupled"], report["modes"][f"v={v} coupled"]
        print(f"v={v}: bubble {d['bubble_mean']:.1%} vs theory {d['theory']:.1%} "
              f"({d['gap_to_theory_points']:+.1f} points) and vs replay "
              f"{d['replay_bubble_mean']:.1%} ({d['runtime_overhead_points']:+.1f} points); "
              f"fastest step {d['fastest_step_bubble_mean']:.1%} "
              f"({d['fastest_gap_to_theory_points']:+.1f} points); "
              f"send blocked {1e3 * d['send_blocked_s']:.1f} ms decoupled vs "
              f"{1e3 * c['send_blocked_s']:.1f} ms coupled; step {d['step_s']:.3f} s vs "
              f"{c['step_s']:.3f} s (coupled/decoupled {c['step_s'] / d['step_s']:.3f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
