"""Overhead of the always-on timers: step time with timers on vs off, alternating in one run.

The step is a real training step of a small GPT (forward and backward per micro-batch, AdamW)
with spans placed as the trainer and the parallel code place them, made pessimistic: a span per
block in forward and backward hooks, and a `comm` span per block's gradient (an empty stand-in
for the reduce-scatter wait that sits inside backward), so each step records dozens of spans.
"On" writes the per-rank JSONL file as in production; "off" is a disabled `Timers`. Rounds of
each mode alternate (on/off, off/on, ...) so machine noise hits both alike; the figure is the
median over rounds of each round's on/off ratio of median step times. Target: < 2 %.

    python bench/timers_overhead.py [--device cuda] [--rounds 10] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megascale.config.schema import ModelConfig
from megascale.diagnostics.timers import Timers
from megascale.model import GPT


def instrument(model: GPT, holder: dict) -> None:
    """Per-block spans in forward (hooks) and a comm span per block in backward."""
    for i, block in enumerate(model.blocks):

        def pre(_m, _a, i=i):
            holder["span"] = holder["timers"].span(f"block{i}.fwd", "compute", layer=i)
            holder["span"].__enter__()

        def post(_m, _a, _o):
            holder["span"].__exit__(None, None, None)

        def grad_ready(_m, _gi, _go, i=i):
            with holder["timers"].span(f"dp.reduce_scatter{i}", "comm", op="reduce_scatter", group="dp"):
                pass

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
        block.register_full_backward_hook(grad_ready)


def run_steps(model, opt, batch, timers: Timers, holder: dict, steps: int, sync) -> list[float]:
    holder["timers"] = timers
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with timers.span("data", "data"):
            x, y = batch
        for mb in range(x.shape[0] // 2):
            xs, ys = x[2 * mb : 2 * mb + 2], y[2 * mb : 2 * mb + 2]
            with timers.span("forward", "compute", mb=mb):
                loss = model(xs, ys) / ys.numel()
            with timers.span("backward", "compute", mb=mb):
                loss.backward()
        with timers.span("optimizer", "optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        t_end = time.perf_counter()
        timers.end_step(len(times))
        key = f"end_step_s_{'on' if timers.enabled else 'off'}"
        holder[key] = holder.get(key, 0.0) + time.perf_counter() - t_end
        sync()
        times.append(time.perf_counter() - start)
    return times


def span_cost_us(timers: Timers, sync, n: int = 2000) -> float:
    """Host time of one empty span (with its CUDA events on GPU); call after `close()`."""
    sync()
    start = time.perf_counter()
    for _ in range(n):
        with timers.span("probe", "compute", layer=0):
            pass
    cost = (time.perf_counter() - start) / n * 1e6
    timers.end_step(-1)
    sync()
    return cost


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences; micro-batches of 2")
    parser.add_argument("--label", default=None, help="key in the JSON (default: the device)")
    parser.add_argument("--out", default="bench/results/timers_overhead.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    cfg = ModelConfig(layers=args.layers, hidden=args.hidden, heads=8, seq_len=args.seq_len)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=device)
    batch = (x, torch.roll(x, -1, dims=1))
    holder: dict = {}
    out_dir = tempfile.mkdtemp(prefix="megascale-timers-bench-")
    on = Timers(0, {"pp": 0, "dp": 0, "tp": 0}, None, out_dir, enabled=True, device=device)
    off = Timers(0, {"pp": 0, "dp": 0, "tp": 0}, None, out_dir, enabled=False, device=device)
    instrument(model, holder)
    run_steps(model, opt, batch, on, holder, 2, sync)  # warm-up both paths
    run_steps(model, opt, batch, off, holder, 2, sync)
    t_on: list[float] = []
    t_off: list[float] = []
    paired: list[float] = []  # per round: median on / median off, measured minutes apart
    for r in range(args.rounds):
        order = ((on, t_on), (off, t_off)) if r % 2 == 0 else ((off, t_off), (on, t_on))
        medians = {}
        for timers, sink in order:
            times = run_steps(model, opt, batch, timers, holder, args.steps, sync)
            sink.extend(times)
            medians[timers.enabled] = statistics.median(times)
        paired.append(medians[True] / medians[False])
    end_step_ms = holder["end_step_s_on"] / (len(t_on) + 2) * 1e3
    on.close()
    spans_per_step = len(on.path.read_text().splitlines()) / (len(t_on) + 2) - 1  # - step row
    span_us = span_cost_us(on, sync) - span_cost_us(off, sync)
    ratio = statistics.median(paired)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "seq_len": cfg.seq_len,
            "batch": args.batch,
            "micro_batch": 2,
        },
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "spans_per_step": round(spans_per_step, 1),
        "step_s_on_median": statistics.median(t_on),
        "step_s_off_median": statistics.median(t_off),
        "end_step_ms_on": end_step_ms,
        "span_us": span_us,  # enter+exit of one empty span, on minus off
        # the timers' own time per step over the step time: robust to a noisy machine
        "direct_overhead_pct": (spans_per_step * span_us / 1e3 + end_step_ms) / (statistics.median(t_off) * 1e3) * 100,
        "paired_ratios": [round(p, 4) for p in paired],
        "overhead_ratio": ratio,  # median over rounds of the paired on/off ratios
        "ratio_of_medians": statistics.median(t_on) / statistics.median(t_off),
        "overhead_pct": (ratio - 1) * 100,
        "target_pct": 2.0,
    }
    print(
        f"step time timers on {result['step_s_on_median'] * 1e3:.2f} ms | off "
        f"{result['step_s_off_median'] * 1e3:.2f} ms | on/off {ratio:.4f} "
        f"({result['overhead_pct']:+.2f} %, {spans_per_step:.0f} spans/step, end_step "
        f"{end_step_ms:.2f} ms; direct cost {result['direct_overhead_pct']:.2f} %, "
        "target < 2 %)"
    )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(path.read_text()) if path.is_file() else {}
    existing[args.label or device.type] = result
    path.write_text(json.dumps(existing, indent=1) + "\n")


if __name__ == "__main__":
    main()
