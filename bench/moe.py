"""MoE benchmark: the expert-parallel all-to-all with the chunked overlap on and off, and
load balance with and without the balancing loss / the DeepSeek-V3 bias.

0. The host's ceiling: one dispatch-sized all-to-all alone, beside a GEMM, and the GEMM alone
   (how much transfer this machine can hide behind compute at all).
1. dp = ep = 2 on gloo (two local ranks). Two copies of one MoE model train side by side in one
   run, `parallel.ep_overlap_chunks` = 2 (overlap: part c+1's dispatch and part c's combine in
   flight while experts compute) and 1 (the plain all-to-all: dispatch, compute, combine);
   rounds of a few steps alternate between them. Per step: wall time (tokens/s), CPU seconds of
   the rank's process (all its threads, gloo's included), and the *exposed* all-to-all time, the
   self time of the `ep.all_to_all*` timer spans (they cover only waits), forward and backward
   apart (both are pipelined with 2 parts), the synchronous exchange of row counts apart again.
2. Load balance on one process: the same small MoE trained on tokens with structure (a few
   recurring phrases over a Zipf background, so the router can specialise) without any
   balancing, with the balancing loss, and with the auxiliary-loss-free bias; per setting the
   mean and last `moe_imbalance` (max/mean tokens per expert of the worst layer).

    python bench/moe.py [--rounds 3] [--steps 4] [--balance-steps 30]
    python bench/moe.py --balance-steps 200          # the issue's 200 steps

Writes bench/results/moe.json. The machine may be loaded (other jobs share its 2 cores): the
ratios are measured side by side in one run, the absolute times are not comparable across runs.
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
from zero_overlap import BenchTrainer  # beside this file (run as `python bench/moe.py`)

from megascale.config.schema import JobConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig
from megascale.data import TokenBatch
from megascale.diagnostics.timers import Timers, set_timers
from megascale.parallel.mesh import init_mesh
from megascale.testing.launch import run_local

RESULTS = Path(__file__).parent / "results" / "moe.json"


def job(
    args: argparse.Namespace, dp: int, ep: int, chunks: int = 1, moe: MoEConfig | None = None, hidden: int | None = None
) -> JobConfig:
    moe = moe or MoEConfig(experts=args.experts, top_k=2, ffn_hidden=args.expert_ffn)
    cfg = JobConfig(
        model=ModelConfig(
            vocab_size=256,
            seq_len=args.seq_len,
            layers=args.layers,
            hidden=hidden or args.hidden,
            heads=4,
            block="serial",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            moe=moe,
        ),
        optim=OptimConfig(name="adamw", lr=3e-3, warmup_steps=0),
        parallel=ParallelConfig(dp=dp, ep=ep, ep_overlap_chunks=chunks, backend="gloo"),
        train=TrainConfig(global_batch=args.micro_batch * dp, micro_batch=args.micro_batch, device="cpu", steps=10**6),
    )
    cfg.validate()
    return cfg


def random_batches(cfg: JobConfig, dp_rank: int, count: int) -> list[TokenBatch]:
    g = torch.Generator().manual_seed(1 + dp_rank)
    shape = (cfg.micro_batches, cfg.train.micro_batch, cfg.model.seq_len + 1)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append(TokenBatch(tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()))
    return out


def _exposed(path: Path) -> dict[int, dict[str, float]]:
    """Per step: self seconds in this rank's all-to-all spans: forward, backward, row counts."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: {"forward": 0.0, "backward": 0.0, "counts": 0.0})
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["name"].startswith("ep.all_to_all"):
            kind = row["name"].rpartition(".")[2]
            out[row["step"]][kind if kind in ("backward", "counts") else "forward"] += row["self"]
    return out


# ---------------------------------------------------------------------------- part 1
def host_ceiling(args: argparse.Namespace, group, repeats: int = 60) -> dict[str, float]:
    """How much of one dispatch-sized all-to-all this host can hide behind a GEMM at all: the
    all-to-all alone, a GEMM alone, and the all-to-all issued before the GEMM and waited for
    after it (medians, both ranks starting together). On CPU the transfer needs both ends'
    gloo threads scheduled, beside ranks that keep every core busy."""
    rows = args.micro_batch * args.seq_len * 2  # top-2 assignments of one micro-batch
    x, out = torch.randn(rows, args.hidden), torch.empty(rows, args.hidden)
    a, b = torch.randn(rows, args.hidden), torch.randn(args.hidden, args.expert_ffn)

    def timed(a2a: bool, gemm: bool) -> float:
        times = []
        for _ in range(repeats):
            torch.distributed.barrier(group=group)
            start = time.perf_counter()
            work = torch.distributed.all_to_all_single(out, x, group=group, async_op=True) if a2a else None
            if gemm:
                a @ b
            if work is not None:
                work.wait()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    alone, gemm, beside = timed(True, False), timed(False, True), timed(True, True)
    return {"a2a_alone_s": alone, "gemm_s": gemm, "a2a_beside_gemm_s": beside, "rows": rows}


def overlap_rank(args: argparse.Namespace, run_dir: str) -> dict:
    mesh = init_mesh(ParallelConfig(dp=2, ep=2, backend="gloo"), device="cpu")
    try:
        ceiling = host_ceiling(args, mesh.ep_group)
        timers = Timers(mesh.rank, mesh.coords._asdict(), None, Path(run_dir) / f"r{mesh.rank}", enabled=True)
        set_timers(timers)
        trainers = {
            mode: BenchTrainer(job(args, 2, 2, chunks), mesh, timers)
            for mode, chunks in (("on", args.chunks), ("off", 1))
        }
        data = random_batches(trainers["on"].cfg, mesh.dp_rank, args.steps)
        steps: dict[str, list[tuple[int, float, float]]] = {m: [] for m in trainers}
        counter = 0
        for _ in range(args.rounds):
            for mode, trainer in trainers.items():
                timers.end_step(counter)
                for i, batch in enumerate(data):
                    cpu = time.process_time()
                    trainer.train_step(batch)
                    cpu = time.process_time() - cpu
                    trainer.step += 1
                    counter += 1
                    totals = timers.end_step(counter)
                    if i:  # the first step of a round warms up
                        steps[mode].append((counter, totals["step"], cpu))
        timers.close()
        exposed = _exposed(timers.path)
        return {
            mode: {
                "step_s": [t for _, t, _ in rows],
                "cpu_s": [c for _, _, c in rows],
                "forward_s": [exposed[s]["forward"] for s, _, _ in rows],
                "backward_s": [exposed[s]["backward"] for s, _, _ in rows],
                "counts_s": [exposed[s]["counts"] for s, _, _ in rows],
            }
            for mode, rows in steps.items()
        } | {"host": ceiling}
    finally:
        mesh.destroy()


# ---------------------------------------------------------------------------- part 2
def structured_batches(cfg: JobConfig, count: int) -> list[TokenBatch]:
    """Zipf-distributed tokens with a few recurring 8-token phrases: inputs a router can split."""
    g = torch.Generator().manual_seed(7)
    vocab, seq = cfg.model.vocab_size, cfg.model.seq_len
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    phrases = torch.randint(0, vocab, (6, 8), generator=g)
    out = []
    for _ in range(count):
        rows = []
        for _ in range(cfg.train.micro_batch):
            row = torch.multinomial(weights, seq + 1, replacement=True, generator=g)
            for start in range(0, seq - 8, 16):
                row[start : start + 8] = phrases[int(torch.randint(0, 6, (1,), generator=g))]
            rows.append(row)
        tokens = torch.stack(rows).unsqueeze(0)
        out.append(TokenBatch(tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()))
    return out


def balance(args: argparse.Namespace) -> dict:
    settings = {
        "none": MoEConfig(experts=args.experts, top_k=2, aux_loss_coef=0.0, z_loss_coef=0.0),
        "aux_loss_0.01": MoEConfig(experts=args.experts, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001),
        "bias_balancing": MoEConfig(
            experts=args.experts,
            top_k=2,
            aux_loss_coef=0.0,
            z_loss_coef=0.001,
            bias_balancing=True,
            bias_update_rate=0.01,
        ),
    }
    mesh = init_mesh(ParallelConfig(), device="cpu")
    set_timers(Timers(0, mesh.coords._asdict(), None, None, enabled=False))
    out = {}
    for name, moe in settings.items():
        cfg = job(args, 1, 1, moe=moe, hidden=args.balance_hidden)
        trainer = BenchTrainer(cfg, mesh, Timers(0, {}, None, None, enabled=False))
        imbalance, losses = [], []
        for batch in structured_batches(cfg, args.balance_steps):
            record = trainer.train_step(batch)
            trainer.step += 1
            imbalance.append(record["moe_imbalance"])
            losses.append(record["loss"])
        tail = imbalance[len(imbalance) // 2 :]
        out[name] = {
            "imbalance_mean": statistics.fmean(imbalance),
            "imbalance_second_half_mean": statistics.fmean(tail),
            "imbalance_last": imbalance[-1],
            "loss_last": losses[-1],
            "steps": len(imbalance),
            "imbalance": [round(v, 3) for v in imbalance],
        }
        print(
            f"  {name:15s}: imbalance (max/mean tokens per expert) mean {out[name]['imbalance_mean']:.2f}, "
            f"second half {out[name]['imbalance_second_half_mean']:.2f}, last {imbalance[-1]:.2f}; "
            f"loss {losses[-1]:.3f}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per round (the first one is not counted)")
    parser.add_argument("--chunks", type=int, default=2, help="parallel.ep_overlap_chunks of the overlapped copy")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--balance-steps", type=int, default=30)
    parser.add_argument("--balance-hidden", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    load_at_start = os.getloadavg()
    print("1. dp = ep = 2, gloo: chunked overlap on vs the plain all-to-all")
    with tempfile.TemporaryDirectory() as run_dir:
        ranks = run_local(overlap_rank, 2, args=(args, run_dir), timeout_s=1800)
    host = {key: statistics.median(r["host"][key] for r in ranks) for key in ranks[0]["host"]}
    exposed_beside = max(host["a2a_beside_gemm_s"] - host["gemm_s"], 0.0)
    host["hidden_share"] = 1 - min(exposed_beside / host["a2a_alone_s"], 1.0)
    print(
        f"  host: one dispatch ({host['rows']:.0f} rows) {host['a2a_alone_s'] * 1e3:.2f} ms alone; beside a "
        f"{host['gemm_s'] * 1e3:.2f} ms GEMM it adds {exposed_beside * 1e3:.2f} ms: this host hides "
        f"{host['hidden_share']:.0%} of it at best"
    )
    part1 = {}
    for mode in ("on", "off"):
        step = statistics.median([t for r in ranks for t in r[mode]["step_s"]])
        fwd = statistics.median([t for r in ranks for t in r[mode]["forward_s"]])
        bwd = statistics.median([t for r in ranks for t in r[mode]["backward_s"]])
        cpu = statistics.median([t for r in ranks for t in r[mode]["cpu_s"]])
        counts = statistics.median([t for r in ranks for t in r[mode]["counts_s"]])
        tokens = args.micro_batch * 2 * args.seq_len / step
        part1[mode] = {
            "step_s_median": step,
            "tokens_per_s": tokens,
            "exposed_forward_a2a_s_median": fwd,
            "exposed_backward_a2a_s_median": bwd,
            "cpu_s_per_step_median": cpu,
            "counts_a2a_s_median": counts,
            "samples": len(ranks[0][mode]["step_s"]),
        }
        print(
            f"  overlap {mode:3s}: step {step * 1e3:7.1f} ms ({tokens:7.0f} tokens/s, {cpu:.2f} CPU s), exposed a2a "
            f"forward {fwd * 1e3:6.2f} ms, backward {bwd * 1e3:6.2f} ms, counts {counts * 1e3:6.2f} ms"
            " (median per step)"
        )
    on, off = part1["on"], part1["off"]
    ratios = {
        "exposed_forward_a2a_on_over_off": on["exposed_forward_a2a_s_median"]
        / max(off["exposed_forward_a2a_s_median"], 1e-9),
        "exposed_backward_a2a_on_over_off": on["exposed_backward_a2a_s_median"]
        / max(off["exposed_backward_a2a_s_median"], 1e-9),
        "exposed_total_a2a_on_over_off": (on["exposed_forward_a2a_s_median"] + on["exposed_backward_a2a_s_median"])
        / max(off["exposed_forward_a2a_s_median"] + off["exposed_backward_a2a_s_median"], 1e-9),
        "tokens_per_s_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
    }
    print(
        f"  on/off: exposed all-to-all forward x{ratios['exposed_forward_a2a_on_over_off']:.2f}, backward "
        f"x{ratios['exposed_backward_a2a_on_over_off']:.2f}, total "
        f"x{ratios['exposed_total_a2a_on_over_off']:.2f}, tokens/s x{ratios['tokens_per_s_on_over_off']:.2f}"
    )

    print(f"2. load balance over {args.balance_steps} steps (one process, {args.experts} experts, top-2)")
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    part2 = balance(args)

    load = os.getloadavg()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1m_at_start": load_at_start[0],
        "load_average_1m_at_end": load[0],
        "note": "gloo on loopback; the load averages above say how busy the host was; "
        "ratios are side by side in one run, absolute times are not comparable across runs",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "host_overlap_ceiling": host,
        "overlap": part1,
        "ratios": ratios,
        "balance": part2,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
