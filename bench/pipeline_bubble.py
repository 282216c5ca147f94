"""Measured pipeline bubble vs theory per schedule, peak activation memory, the end-of-step
sync, and exposed send/recv time with and without decoupling.

One run spawns `p` gloo ranks (one thread each) and trains the same GPT with six runners,
alternating step by step so machine noise hits all alike: 1F1B, interleaved 1F1B (v=2), ZB-H1
and ZB-V (split backward; ZB-V's two chunks per rank in a V) with decoupled sends (the default:
isend, waited lazily), and 1F1B and interleaved with coupled sends (each send waited before
going on).
Every action is timed by the runner itself (`pp.forward`/`pp.backward`/`pp.weight` compute
spans, `pp.recv`/`pp.send`/`pp.send_wait` p2p spans, read back from the per-rank timer files).
A step's window runs from a common start (after a barrier) to the moment the last rank
finishes; a rank's idle time is the window minus its compute, and its bubble is idle / compute,
which theory puts at (p-1)/(v*m) for 1F1B and (p-1)/(3m) for ZB-H1 (F = B = W in time). The
model is sized so that compute dominates (wide layers, a tiny vocabulary, so the embedding and
head add little imbalance). Target: measured within 2 points of theory.
Figures are medians over the measured steps, plus the bubble of each mode's fastest step (noise
only adds time), plus a replay: the schedule simulated with the step's measured compute times
and ideal links, which separates stage imbalance (in the replay) from runtime overhead (the
difference between measured and replay). The same replay at `--replay-p` (default 4) plays
that pipeline depth with the mean F/B/W times measured here (where the cores for a real run
are not there).

End-of-step sync: after its last action each rank runs the global gradient-norm all-reduce
that clipping and the non-finite check need (`optim.global_grad_norm` over pp); `sync_s` is how
long it blocks there, waiting for the slowest stage.
Memory: one extra step per schedule runs under the profiler's CPU memory accounting; the peak
of bytes allocated above the step's start is the schedule's activation (and W-stash) peak.

    python bench/pipeline_bubble.py [--p 2] [--m 8] [--hidden 256] [--rounds 3]
    python bench/pipeline_bubble.py --memory-only   # one warm-up step, then each mode's peak
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
from megascale.optim import global_grad_norm
from megascale.parallel import init_mesh
from megascale.parallel.pipeline import PipelineRunner, build_schedule, simulate, split_model
from megascale.parallel.pipeline.schedule import V_SHAPED, Op
from megascale.testing.launch import run_local

# name -> (parallel.schedule, v, decoupled)
MODES = {
    "1f1b": ("1f1b", 1, True),
    "interleaved": ("1f1b", 2, True),
    "zb-h1": ("zb-h1", 1, True),
    "zbv": ("zbv", 2, True),
    "1f1b coupled": ("1f1b", 1, False),
    "interleaved coupled": ("1f1b", 2, False),
}


def theory(kind: str, p: int, v: int, m: int) -> float:
    """Idle / compute with F = B (= W) per chunk: ZB-V idles p-1 chunk-ops in 6m (simulated,
    m >= 2p-1), ZB-H1 p-1 stage-ops in 3m, (interleaved) 1F1B (p-1)/(v m)."""
    if kind == "zbv":
        return simulate(build_schedule(kind, p, v, m)).idle[0] / (6 * m)
    return (p - 1) / (3 * m) if kind == "zb-h1" else (p - 1) / (v * m)


def job(args, kind: str, v: int) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(
            vocab_size=64, seq_len=args.seq, layers=args.layers, hidden=args.hidden, heads=8, positions="learned"
        ),
        parallel=ParallelConfig(pp=args.p, vpp=v, schedule=kind),
        train=TrainConfig(micro_batch=args.micro_batch, global_batch=args.micro_batch * args.m, device="cpu"),
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
        for name, (kind, v, decoupled) in MODES.items():
            cfg = job(args, kind, v)
            torch.manual_seed(0)
            chunks = split_model(GPT(cfg.model), args.p, v, mesh.pp_rank, cfg.parallel.pp_split, kind in V_SHAPED)
            runners[name] = PipelineRunner(chunks, cfg, mesh, decoupled=decoupled)
        g = torch.Generator().manual_seed(1)
        shape = (args.m, args.micro_batch, args.seq)
        batch = TokenBatch(torch.randint(0, 64, shape, generator=g), torch.randint(0, 64, shape, generator=g))
        tokens = batch.labels.numel()
        windows: dict[int, tuple[str, float, float]] = {}
        step = 0
        for rnd in range(args.rounds + 1):  # round 0 warms up (shapes, allocator, gloo pairs)
            order = list(MODES) if rnd % 2 else list(MODES)[::-1]
            for name in order:
                runner = runners[name]
                dist.barrier()
                timers.end_step(step)  # flush what came before; the step's spans start here
                step += 1
                start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for all processes
                runner.forward_backward(batch, tokens)
                done = time.perf_counter()
                global_grad_norm([p for _, p in runner.named_parameters()], across=[mesh.pp_group])
                sync = time.perf_counter() - done  # blocked in the end-of-step all-reduce
                span = torch.tensor([-start, done], dtype=torch.float64)
                dist.all_reduce(span, op=dist.ReduceOp.MAX)
                runner.zero_grad()
                if rnd > 0:
                    windows[step] = (name, float(span[0] + span[1]), sync)
        timers.end_step(step)
        memory = {name: peak_step_bytes(runner, batch, tokens) for name, runner in runners.items() if MODES[name][2]}
        return {"rank": mesh.rank, "windows": windows, "contention": shared, "memory": memory}
    finally:
        timers.close()
        mesh.destroy()


def peak_step_bytes(runner: PipelineRunner, batch: TokenBatch, tokens: int) -> int:
    """Peak CPU bytes allocated during one step above its start (profiler memory events)."""
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.forward_backward(batch, tokens)
    runner.zero_grad()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


COMPUTE_SPANS = {"pp.forward": Op.FORWARD, "pp.backward": Op.BACKWARD, "pp.weight": Op.WEIGHT}


def collect(out_dir: Path, results: list[dict], args) -> dict:
    """Per mode and rank (medians over the measured steps): compute, idle, measured bubble,
    the bubble the schedule predicts when replayed with this step's measured compute times
    and ideal links, and the time spent in receive waits and sends."""
    table: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    steps: dict[int, dict[int, dict]] = defaultdict(dict)  # step -> rank -> per-step figures
    modes: dict[int, str] = {}
    for res in results:
        rank = res["rank"]
        per_step: dict[int, dict] = defaultdict(lambda: defaultdict(float))
        for line in (out_dir / "timers" / f"rank{rank:05d}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            name, s = rec["name"], per_step[rec["step"]]
            if name in COMPUTE_SPANS:
                s["compute"] += rec["self"]
                op = COMPUTE_SPANS[name]
                s.setdefault("times", {})[(op, rec["attrs"]["mb"], rec["attrs"]["chunk"])] = rec["dur"]
            elif name == "pp.recv":
                s["recv"] += rec["self"]
            elif name in ("pp.send", "pp.send_wait"):  # not pp.send_drain: nothing left to do
                s["send"] += rec["self"]
        for step, (mode, window, sync) in res["windows"].items():
            steps[step][rank] = dict(per_step[step], window=window, sync=sync)
            modes[step] = mode
    for step, ranks in steps.items():
        mode = modes[step]
        kind, v, _ = MODES[mode]
        replay = simulate(
            build_schedule(kind, args.p, v, args.m),
            duration=lambda r, a, ranks=ranks: ranks[r]["times"][(a.op, a.mb, a.chunk)],
        )
        for rank, s in ranks.items():
            for op, mean in op_means(s["times"]).items():
                table[mode][rank][f"t_{op.value}"].append(mean)
            table[mode][rank]["sync"].append(s["sync"])
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


def op_means(times: dict[tuple[Op, int, int], float]) -> dict[Op, float]:
    """Mean duration of each compute kind (F, B, W) over a step's actions."""
    by_op: dict[Op, list[float]] = defaultdict(list)
    for (op, _, _), t in times.items():
        by_op[op].append(t)
    return {op: statistics.mean(ts) for op, ts in by_op.items()}


def deeper_replay(mode_ranks: dict[int, dict[str, float]], kind: str, v: int, p: int, m: int) -> float:
    """The bubble of the schedule at depth `p`, played with the mean F/B/W times measured
    (averaged over the ranks; the stage's layer count scales them all alike)."""
    means = {
        op: statistics.mean(r[f"t_{op.value}"] for r in mode_ranks.values())
        for op in COMPUTE_SPANS.values()
        if f"t_{op.value}" in next(iter(mode_ranks.values()))
    }
    sim = simulate(build_schedule(kind, p, v, m), duration=lambda _r, a: means[a.op])
    return statistics.mean(i / b for i, b in zip(sim.idle, sim.busy, strict=True))


def memory_report(args, results: list[dict], load: tuple[float, ...]) -> int:
    """Peak bytes per mode and rank against 1F1B's, and what the schedule holds (simulated)."""
    memory: dict[str, dict] = {}
    base = {r["rank"]: r["memory"]["1f1b"] for r in results}
    for mode, (kind, v, decoupled) in MODES.items():
        if not decoupled:
            continue
        sim = simulate(build_schedule(kind, args.p, v, args.m))
        peaks = {r["rank"]: r["memory"][mode] for r in results}
        memory[mode] = {
            "peak_bytes": peaks,
            "vs_1f1b_same_rank": {r: peaks[r] / base[r] for r in peaks},
            "vs_1f1b_max": max(peaks.values()) / max(base.values()),
            "schedule_peak_activations": sim.peak_activations,
            "schedule_peak_held": sim.peak_held,
        }
        print(
            f"{mode:<12} peak MiB per rank {[round(b / 2**20, 1) for b in peaks.values()]}; vs 1F1B same rank "
            f"{[round(x, 2) for x in memory[mode]['vs_1f1b_same_rank'].values()]}; max vs 1F1B's max "
            f"{memory[mode]['vs_1f1b_max']:.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": vars(args), "torch": torch.__version__, "load_average_at_start": load, "memory": memory}
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--replay-p", type=int, default=4, help="pipeline depth replayed with the measured op times")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin each rank to its own physical core (pinned when enough)",
    )
    ap.add_argument("--memory-only", action="store_true", help="only each mode's peak bytes (no timed rounds)")
    ap.add_argument("--out", default="bench/results/pipeline_bubble.json")
    args = ap.parse_args()
    if args.memory_only:
        args.rounds = 0

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_local(rank_main, args.p, (args, tmp), timeout_s=1800)
        stats = collect(Path(tmp), results, args)
    if args.memory_only:
        return memory_report(args, results, load)

    report = {
        "config": vars(args),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average_at_start": load,
        "modes": {},
        "contention": {r["rank"]: r["contention"] for r in results},
        "note": (
            "figures taken on a shared, loaded machine (load average above): ratios of "
            "modes measured side by side in one run; absolute times are noisy"
        )
        if load[0] > (os.cpu_count() or 1) * 0.5
        else "machine quiet at start",
    }
    slow = statistics.mean(r["contention"]["slowdown"] for r in results)
    print(
        f"load average at start {load}; compute contention: the same GEMM loop takes {slow:.2f}x "
        "as long with every rank computing as with one rank alone (1.00: independent cores)"
    )
    print(
        f"p={args.p} m={args.m}: bubble = idle / compute per rank (median of {args.rounds}); "
        "replay = the schedule played with the measured compute times and ideal links"
    )
    print(
        f"{'mode':<20} {'rank':>4} {'compute s':>9} {'idle s':>7} {'bubble':>7} {'replay':>7} "
        f"{'fastest':>7} {'theory':>7} {'recv ms':>8} {'send ms':>8} {'sync ms':>8} {'step s':>7} "
        f"{'peak MiB':>8}"
    )
    for mode, ranks in stats.items():
        kind, v, decoupled = MODES[mode]
        theo = theory(kind, args.p, v, args.m)
        peaks = {r["rank"]: r["memory"].get(mode) for r in results}
        for rank, s in ranks.items():
            s["peak_bytes"] = peaks[rank]
            peak = "-" if peaks[rank] is None else f"{peaks[rank] / 2**20:8.1f}"
            print(
                f"{mode:<20} {rank:>4} {s['compute']:9.3f} {s['idle']:7.3f} {s['bubble']:7.1%} "
                f"{s['replay_bubble']:7.1%} {s['fastest_bubble']:7.1%} {theo:7.1%} "
                f"{1e3 * s['recv']:8.1f} {1e3 * s['send']:8.1f} {1e3 * s['sync']:8.1f} "
                f"{s['window']:7.3f} {peak:>8}"
            )
        mean = {
            k: statistics.mean(s[k] for s in ranks.values())
            for k in ("bubble", "replay_bubble", "fastest_bubble", "window", "sync")
        }
        sim = simulate(build_schedule(kind, args.p, v, args.m))
        report["modes"][mode] = {
            "schedule": kind,
            "v": v,
            "decoupled": decoupled,
            "theory": theo,
            "bubble_mean": mean["bubble"],
            "replay_bubble_mean": mean["replay_bubble"],
            "fastest_step_bubble_mean": mean["fastest_bubble"],
            "fastest_gap_to_theory_points": 100 * (mean["fastest_bubble"] - theo),
            "gap_to_theory_points": 100 * (mean["bubble"] - theo),
            "runtime_overhead_points": 100 * (mean["bubble"] - mean["replay_bubble"]),
            f"replay_bubble_p{args.replay_p}": deeper_replay(ranks, kind, v, args.replay_p, args.m),
            f"theory_p{args.replay_p}": theory(kind, args.replay_p, v, args.m),
            "step_s": mean["window"],
            "end_of_step_sync_s_mean": mean["sync"],
            "send_blocked_s": sum(s["send"] for s in ranks.values()),
            "recv_wait_s": sum(s["recv"] for s in ranks.values()),
            "peak_bytes_max": None if None in peaks.values() else max(peaks.values()),
            "schedule_peak_activations": sim.peak_activations,  # micro-batches, F to B
            "schedule_peak_held": sim.peak_held,  # micro-batches, F to last W (or B)
            "ranks": ranks,
        }
    print()
    modes = report["modes"]
    for mode in ("1f1b", "interleaved", "zb-h1", "zbv"):
        d = modes[mode]
        deep = f"replay_bubble_p{args.replay_p}"
        print(
            f"{mode:<12} bubble {d['bubble_mean']:.1%} vs theory {d['theory']:.1%} "
            f"({d['gap_to_theory_points']:+.1f} points), replay {d['replay_bubble_mean']:.1%}, "
            f"fastest step {d['fastest_step_bubble_mean']:.1%}; p={args.replay_p} replay "
            f"{d[deep]:.1%} vs theory {d[f'theory_p{args.replay_p}']:.1%}; step {d['step_s']:.3f} s; "
            f"end-of-step sync {1e3 * d['end_of_step_sync_s_mean']:.1f} ms; peak "
            f"{(d['peak_bytes_max'] or 0) / 2**20:.1f} MiB"
        )
    for mode in ("1f1b", "interleaved"):
        d, c = modes[mode], modes[f"{mode} coupled"]
        print(
            f"{mode}: send blocked {1e3 * d['send_blocked_s']:.1f} ms decoupled vs "
            f"{1e3 * c['send_blocked_s']:.1f} ms coupled; step {d['step_s']:.3f} s vs "
            f"{c['step_s']:.3f} s (coupled/decoupled {c['step_s'] / d['step_s']:.3f})"
        )
    zb, zbv, inter = modes["zb-h1"], modes["zbv"], modes["interleaved"]
    report["zb_h1_vs_interleaved"] = {
        "bubble_points": 100 * (zb["bubble_mean"] - inter["bubble_mean"]),
        "step_ratio": zb["step_s"] / inter["step_s"],
        "zb_h1_gap_to_its_theory_points": zb["gap_to_theory_points"],
    }
    report["zbv_vs_zb_h1"] = {
        "bubble_points": 100 * (zbv["bubble_mean"] - zb["bubble_mean"]),
        "step_ratio": zbv["step_s"] / zb["step_s"],
        "zbv_gap_to_its_theory_points": zbv["gap_to_theory_points"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
