"""Peer benchmark (issue 22): megascale's hand-written TP/PP/ZeRO-2 against the PyTorch-native
composition a user would write from the torchtitan recipe (`bench/peers_native.py`): the same
GPT, data, layout and optimizer (AdamW, global-norm clipping), in one run.

Per layout (default dp2, tp2, pp2v2 and dp2tp2pp2v2 on gloo/CPU):
1. Both are built on the same ranks and trained step by step in alternation (the order flips
   every step). Measured per step: wall time (tokens/s from the median), the exposed
   communication per mesh dimension -- megascale from its own timer spans (kind comm/p2p,
   summed by their `group`; they cover only waits), the peer from `CommClock` (host time in its
   synchronous collectives, DTensor waits and pipeline p2p waits) -- and the loss, which must
   agree: both start from `initial_value(seed, name)` and see the same tokens.
2. Start-up and memory need a process each: each side alone on fresh ranks -- process groups,
   model build (meta, parallelise, values), first step -- then a few steps for peak RSS (on a
   GPU, peak allocated memory).

    python bench/peers.py [--layouts dp2 tp2 pp2v2 dp2tp2pp2v2] [--steps 8] [--hidden 256]
    python bench/peers.py --device cuda --dtype bf16      # NCCL, on a GPU machine

Prints megascale/peer ratios side by side; writes bench/results/peers.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from peers_native import NativePeer  # beside this file (run as `python bench/peers.py`)

from megascale.checkpoint.stateful import TrainState
from megascale.config.schema import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megascale.data import TokenBatch
from megascale.diagnostics.timers import Timers, set_timers
from megascale.model import GPT, IGNORE_INDEX
from megascale.optim import build_optimizer
from megascale.parallel.engine import build_runner
from megascale.parallel.mesh import ParallelMesh, init_mesh
from megascale.parallel.pipeline.split import chunk_layers, chunk_sizes
from megascale.parallel.timed_comm import timed_all_reduce
from megascale.testing.launch import run_local
from megascale.train.trainer import Trainer

RESULTS = Path(__file__).parent / "results" / "peers.json"
DEFAULT_LAYOUTS = ("dp2", "tp2", "pp2v2", "dp2tp2pp2v2")
SIDES = ("megascale", "peer")
# fp32: the sides add the same terms in other orders (~1e-7 relative in the gradients). Losses
# alone would hide a wrong gradient scale (AdamW's first steps barely depend on it), so the
# gradient norms before clipping must agree too.
RTOL = 1e-5


def parse_layout(name: str) -> dict[str, int]:
    """'dp2tp2pp2v2' -> {'dp': 2, 'tp': 2, 'pp': 2, 'v': 2, 'zbv': 0}; missing dimensions are 1.
    A trailing 'zbv' (e.g. 'pp2v2zbv') runs the zero-bubble V schedule on both sides:
    `parallel.schedule = "zbv"` against `ScheduleZBVZeroBubble`."""
    zbv = name.endswith("zbv")
    dims = name[:-3] if zbv else name
    pairs = re.findall(r"(dp|tp|pp|v)(\d+)", dims)
    parts = dict(pairs)
    if not pairs or "".join(k + v for k, v in pairs) != dims or len(parts) != len(pairs):
        raise SystemExit(
            f"layout {name!r}: write it as dimension-size pairs, e.g. dp2, tp2, pp2v2, dp2tp2pp2v2, pp2v2zbv"
        )
    layout = {d: int(parts.get(d, 1)) for d in ("dp", "tp", "pp", "v")} | {"zbv": int(zbv)}
    if layout["v"] > 1 and layout["pp"] == 1:
        raise SystemExit(f"layout {name!r}: v > 1 needs pp > 1")
    if zbv and layout["v"] != 2:
        raise SystemExit(f"layout {name!r}: zbv runs two chunks per stage: write v2")
    return layout


def check_runnable(name: str, layout: dict[str, int], args: argparse.Namespace) -> None:
    """Refuse, in one line, what is known not to run before starting any rank."""
    world = layout["dp"] * layout["tp"] * layout["pp"]
    if args.device == "cuda" and world > torch.cuda.device_count():
        raise SystemExit(
            f"layout {name!r} needs {world} GPUs, one per rank (NCCL refuses two ranks on one "
            f"GPU); this machine has {torch.cuda.device_count()}"
        )
    if args.compile and layout["tp"] > 1 and args.device == "cpu":
        raise SystemExit(
            f"layout {name!r}: --compile with tp > 1 fails on CPU (the peer's compiled DTensor "
            "blocks raise in backward, torch 2.13); drop --compile or tp"
        )


def job(args: argparse.Namespace, layout: dict[str, int]) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(
            vocab_size=args.vocab,
            seq_len=args.seq_len,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            block=args.block,
        ),
        optim=OptimConfig(name="adamw", lr=args.lr, warmup_steps=2, weight_decay=0.1, grad_clip=1.0),
        parallel=ParallelConfig(
            dp=layout["dp"],
            tp=layout["tp"],
            pp=layout["pp"],
            vpp=layout["v"],
            schedule="zbv" if layout.get("zbv") else "1f1b",
            backend="nccl" if args.device == "cuda" else "gloo",
        ),
        train=TrainConfig(
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            device=args.device,
            dtype=args.dtype,
            compile=args.compile,
            steps=args.warmup + args.steps,
            seed=args.seed,
        ),
    )
    cfg.validate()
    return cfg


def layers(cfg: JobConfig) -> list[range]:
    """The layers of each pipeline chunk: megascale's split (`parallel.pp_split`), given to the
    peer as its split points, so that both sides' stages do the same work."""
    p = cfg.parallel
    return chunk_layers(chunk_sizes(cfg.model, p.pp, p.vpp, p.pp_split))


def global_batches(cfg: JobConfig, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens, a few labels ignored (so token counts differ between dp ranks)."""
    g = torch.Generator().manual_seed(cfg.train.seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.05] = IGNORE_INDEX
        out.append((tokens[:, :-1].contiguous(), labels))
    return out


def rank_slice(batch: tuple[torch.Tensor, torch.Tensor], cfg: JobConfig, dp_rank: int) -> tuple:
    per = cfg.train.global_batch // cfg.parallel.dp
    return tuple(t[dp_rank * per : (dp_rank + 1) * per] for t in batch)


class MegascaleSide(Trainer):
    """`Trainer.train_step` on a model built as the trainer builds it (meta, then this rank's
    part), without loaders, checkpoints or metrics."""

    def __init__(self, cfg: JobConfig, mesh: ParallelMesh, timers: Timers) -> None:
        self.cfg, self.mesh, self.train_state, self.timers = cfg, mesh, TrainState(), timers  # step 0
        with torch.device("meta"):
            model = GPT(cfg.model)
        self.runner = build_runner(model, cfg, mesh)
        self.sum_over = partial(timed_all_reduce, mesh=mesh)  # as the Trainer: its step reads it
        self.optimizer = build_optimizer(self.runner.optimizer_tensors(), cfg.optim, self.sum_over)
        self.init_numerics()

    def bench_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        shape = (self.cfg.micro_batches, self.cfg.train.micro_batch, self.cfg.model.seq_len)
        record = self.train_step(TokenBatch(inputs.view(shape), labels.view(shape)))
        self.step += 1
        if self.runner.grad_sync is not None:
            # In training, the next step's first parameter all-gather (launched after the
            # optimizer step) overlaps data loading; here there is none, and the peer's step
            # must not hide it, so it is waited for inside this step (and counted).
            self.runner.grad_sync.before_forward(0)
        return {"loss": record["loss"], "grad_norm": record["grad_norm"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timers(mesh: ParallelMesh, out_dir: str | None) -> Timers:
    timers = Timers(mesh.rank, mesh.coords._asdict(), None, out_dir, enabled=True, device=mesh.device)
    set_timers(timers)
    return timers


def megascale_spans(path: Path) -> dict[int, dict[str, float]]:
    """Per step, from megascale's timer file: the self time of its comm/p2p spans summed by mesh
    dimension, and of its optimizer span (clipping and the optimizer step)."""
    steps: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["kind"] in ("comm", "p2p", "optimizer"):
            key = row["attrs"].get("group", "world") if row["kind"] != "optimizer" else "optimizer"
            per = steps.setdefault(row["step"], {})
            per[key] = per.get(key, 0.0) + row["self"]
    return steps


# ---------------------------------------------------------------------------- part 1
def alternating_rank(args: argparse.Namespace, layout: dict[str, int]) -> dict:
    """Both sides on this rank, one step each in turn; the first `warmup` steps are not kept."""
    torch.set_num_threads(1)
    cfg = job(args, layout)
    mesh = init_mesh(cfg.parallel, device=args.device)
    with tempfile.TemporaryDirectory(prefix="megascale-peers-") as tmp:
        try:
            timers = _timers(mesh, tmp)
            sides = {"megascale": MegascaleSide(cfg, mesh, timers), "peer": NativePeer(cfg, mesh.device, layers(cfg))}
            out = {s: {"step_s": [], "loss": [], "grad_norm": [], "comm": [], "optimizer_s": []} for s in SIDES}
            for i, batch in enumerate(global_batches(cfg, args.warmup + args.steps)):
                inputs, labels = rank_slice(batch, cfg, mesh.dp_rank)
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    _sync(mesh.device)
                    start = time.perf_counter()
                    if side == "megascale":
                        record = sides[side].bench_step(inputs, labels)
                    else:
                        record = sides[side].train_step(inputs, labels)
                    _sync(mesh.device)
                    elapsed = time.perf_counter() - start
                    if side == "megascale":
                        timers.end_step(i + 1)
                    else:
                        out[side]["comm"].append(sides[side].clock.take())
                        out[side]["optimizer_s"].append(sides[side].optimizer_s)
                    out[side]["step_s"].append(elapsed)
                    for key in ("loss", "grad_norm"):
                        out[side][key].append(record[key])
            timers.close()
            spans = megascale_spans(Path(tmp) / "timers" / f"rank{mesh.rank:05d}.jsonl")
            per_step = [spans.get(i + 1, {}) for i in range(args.warmup + args.steps)]
            out["megascale"]["optimizer_s"] = [s.pop("optimizer", 0.0) for s in per_step]
            out["megascale"]["comm"] = per_step
            if mesh.device.type == "cuda":  # the peer's host waits say nothing about GPU overlap
                out["peer"]["comm"] = [{} for _ in out["peer"]["comm"]]
            out["untimed_async"] = sides["peer"].clock.untimed
            out["peer_async_tp"] = sides["peer"].async_tp
            return out
        finally:
            mesh.destroy()


# ---------------------------------------------------------------------------- part 2
def startup_rank(args: argparse.Namespace, layout: dict[str, int], side: str) -> dict:
    """One side alone on fresh ranks: process groups, build, first step; then peak memory."""
    torch.set_num_threads(1)
    cfg = job(args, layout)
    base = 0 if args.device == "cuda" else psutil.Process().memory_info().rss
    start = time.perf_counter()
    if side == "megascale":
        mesh = init_mesh(cfg.parallel, device=args.device)
        device, dp_rank = mesh.device, mesh.dp_rank
    else:
        device = _peer_device(args.device)
        dist.init_process_group(cfg.parallel.backend)
    t_groups = time.perf_counter()
    if side == "megascale":
        model = MegascaleSide(cfg, mesh, _timers(mesh, None))
        step = model.bench_step
    else:
        model = NativePeer(cfg, device, layers(cfg))
        dp_rank = model.mesh["dp"].get_local_rank()
        step = model.train_step
    t_build = time.perf_counter()
    batches = [rank_slice(b, cfg, dp_rank) for b in global_batches(cfg, 1 + args.memory_steps)]
    step(*batches[0])
    _sync(device)
    t_first = time.perf_counter()
    for batch in batches[1:]:
        step(*batch)
    _sync(device)
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    if side == "megascale":
        mesh.destroy()
    else:
        dist.destroy_process_group()
    mesh_s = model.mesh_s if side == "peer" else 0.0  # the peer makes its sub-groups while building
    return {
        "groups_s": t_groups - start + mesh_s,
        "build_s": t_build - t_groups - mesh_s,
        "first_step_s": t_first - t_build,
        "total_s": t_first - start,
        "peak_mib": peak / 2**20,
        "base_mib": base / 2**20,
    }


def _peer_device(choice: str) -> torch.device:
    if choice != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# ---------------------------------------------------------------------------- report
def summarize(args: argparse.Namespace, layout: dict[str, int], ranks: list[dict]) -> dict:
    """Kept steps only. A step ends when its slowest rank does; comm is the mean over ranks."""
    keep = slice(args.warmup, None)
    tokens = args.global_batch * args.seq_len
    row: dict = {}
    for side in SIDES:
        steps = [max(r[side]["step_s"][i] for r in ranks) for i in range(len(ranks[0][side]["step_s"]))][keep]
        comm: dict[str, float] = {}
        for r in ranks:
            for per in r[side]["comm"][keep]:
                for dim, s in per.items():
                    comm[dim] = comm.get(dim, 0.0) + s / len(ranks) / len(steps)
        optimizer = statistics.fmean(s for r in ranks for s in r[side]["optimizer_s"][keep])
        row[side] = {
            "tokens_per_s": tokens / statistics.median(steps),
            "step_s": steps,
            "comm_s_per_step": comm,
            "optimizer_s_per_step": optimizer,
            "loss": ranks[0][side]["loss"],
            "grad_norm": ranks[0][side]["grad_norm"],
        }
    for key in ("loss", "grad_norm"):
        row[f"{key}_max_rel_diff"] = max(
            abs(a - b) / abs(b) for a, b in zip(row["megascale"][key], row["peer"][key], strict=True)
        )
    row["losses_agree"] = max(row["loss_max_rel_diff"], row["grad_norm_max_rel_diff"]) <= RTOL
    row["losses_agree_on_every_rank"] = all(r[s]["loss"] == ranks[0][s]["loss"] for r in ranks for s in SIDES)
    row["tokens_per_s_ratio"] = row["megascale"]["tokens_per_s"] / row["peer"]["tokens_per_s"]
    # robust to load that changes over the run: adjacent steps compared, and the fastest steps
    pairs = zip(row["megascale"]["step_s"], row["peer"]["step_s"], strict=True)
    row["paired_step_ratio"] = statistics.median(p / m for m, p in pairs)
    row["fastest_step_ratio"] = min(row["peer"]["step_s"]) / min(row["megascale"]["step_s"])
    row["peer_untimed_async_collectives"] = max(r["untimed_async"] for r in ranks)
    row["peer_async_tp"] = ranks[0]["peer_async_tp"]
    return row


def add_startup(row: dict, startup: dict[str, list[dict]]) -> None:
    for side in SIDES:
        ranks = startup[side]
        row[side]["startup"] = {k: max(r[k] for r in ranks) for k in ("groups_s", "build_s", "first_step_s", "total_s")}
        row[side]["peak_mib_per_rank"] = [r["peak_mib"] for r in ranks]
        row[side]["base_mib_per_rank"] = [r["base_mib"] for r in ranks]
    row["startup_ratio"] = row["megascale"]["startup"]["total_s"] / row["peer"]["startup"]["total_s"]
    row["peak_memory_ratio"] = max(row["megascale"]["peak_mib_per_rank"]) / max(row["peer"]["peak_mib_per_rank"])


def print_row(name: str, row: dict) -> None:
    ms, peer = row["megascale"], row["peer"]
    print(
        f"\n{name}: tokens/s megascale {ms['tokens_per_s']:.0f}, peer {peer['tokens_per_s']:.0f}: "
        f"x{row['tokens_per_s_ratio']:.2f} (adjacent steps x{row['paired_step_ratio']:.2f}, fastest steps "
        f"x{row['fastest_step_ratio']:.2f}); max rel diff of losses {row['loss_max_rel_diff']:.1e}, of "
        f"grad norms {row['grad_norm_max_rel_diff']:.1e} ({'agree' if row['losses_agree'] else 'DISAGREE'})"
    )
    for dim in sorted(set(ms["comm_s_per_step"]) | set(peer["comm_s_per_step"])):
        a, b = ms["comm_s_per_step"].get(dim, 0.0), peer["comm_s_per_step"].get(dim, 0.0)
        ratio = f"x{a / b:.2f}" if b > 0 else "-"
        print(f"  exposed {dim} comm per step: megascale {a * 1e3:7.1f} ms, peer {b * 1e3:7.1f} ms  {ratio}")
    parts = [
        (statistics.fmean(row[s]["step_s"]), sum(row[s]["comm_s_per_step"].values()), row[s]["optimizer_s_per_step"])
        for s in SIDES
    ]
    print(
        "  step (mean, ms) = exposed comm + optimizer + the rest (compute, framework): "
        + "; ".join(
            f"{side} {step * 1e3:.0f} = {comm * 1e3:.0f} + {opt * 1e3:.0f} + {(step - comm - opt) * 1e3:.0f}"
            for side, (step, comm, opt) in zip(SIDES, parts, strict=True)
        )
    )
    if "startup" in ms:
        a, b = ms["startup"], peer["startup"]
        print(
            f"  start-up: megascale {a['total_s']:.2f} s (groups {a['groups_s']:.2f}, build {a['build_s']:.2f}, "
            f"first step {a['first_step_s']:.2f}), peer {b['total_s']:.2f} s (groups {b['groups_s']:.2f}, "
            f"build {b['build_s']:.2f}, first step {b['first_step_s']:.2f}): x{row['startup_ratio']:.2f}"
        )
        growth = {
            side: max(
                p - b for p, b in zip(row[side]["peak_mib_per_rank"], row[side]["base_mib_per_rank"], strict=True)
            )
            for side in SIDES
        }
        print(
            f"  peak memory per rank (max): megascale {max(ms['peak_mib_per_rank']):.0f} MiB, "
            f"peer {max(peer['peak_mib_per_rank']):.0f} MiB: x{row['peak_memory_ratio']:.2f} (above the "
            f"memory before start-up: {growth['megascale']:.0f} and {growth['peer']:.0f} MiB)"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS))
    parser.add_argument("--steps", type=int, default=8, help="kept steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="steps per side not kept")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512, help="divisible by tp (vocabulary-parallel)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--block", choices=("parallel", "serial"), default="parallel")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every block on both sides (the peer then uses async-TP on CUDA)",
    )
    parser.add_argument("--memory-steps", type=int, default=3, help="steps after the first in part 2")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="CPU: glibc's MALLOC_MMAP_THRESHOLD_ for every rank of both sides (0: glibc's own, "
        "dynamic), so that freed buffers leave the peak RSS as they leave the allocator",
    )
    parser.add_argument("--no-startup", action="store_true", help="skip part 2 (start-up and memory)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per multi-process run")
    parser.add_argument("--note", default="", help="recorded with the results (e.g. 'under load')")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {RESULTS}, or $OUT/peers.json)")
    args = parser.parse_args(argv)
    layouts = {name: parse_layout(name) for name in args.layouts}
    for name, layout in layouts.items():
        check_runnable(name, layout, args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.device == "cpu" and args.mmap_threshold:
        # Read by glibc when each rank's process starts. Its default threshold rises to the
        # largest block freed (up to 32 MiB), after which such blocks come from the heap and
        # stay in the RSS once freed: the peak RSS then counts allocator retention, not use.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    report: dict = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "note": args.note,
        "memory": "peak allocated (cuda)" if args.device == "cuda" else "peak RSS (ru_maxrss)",
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "layouts": {},
    }
    for name, layout in layouts.items():
        world = layout["dp"] * layout["tp"] * layout["pp"]
        ranks = run_local(alternating_rank, world, args=(args, layout), timeout_s=args.timeout)
        row = summarize(args, layout, ranks)
        if not args.no_startup:
            add_startup(
                row,
                {
                    side: run_local(startup_rank, world, args=(args, layout, side), timeout_s=args.timeout)
                    for side in SIDES
                },
            )
        report["layouts"][name] = row
        print_row(name, row)
    out = args.out or (Path(os.environ["OUT"]) / "peers.json" if os.environ.get("OUT") else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
