"""One-script single-GPU efficiency check (issue 12): parity of every fused path, the GEMM
ceiling, and training MFU of ~1.3B and ~2.7B GPTs (serial vs parallel block, full vs SWA,
compile on/off). Fits an 8-minute budget on one H200: variants that would not fit are listed
as skipped, never guessed. Prints a table last and writes JSON to $OUT (or bench/results).

    python bench/gpu/run.py                 # on a GPU
    python bench/gpu/run.py --dry-run       # tiny models on CPU: exercises every code path

Each variant trains through megascale's own `Trainer` (data loader, LAMB, clipping, timers) on
a synthetic dataset, in bf16 autocast with fp32 parameters, so the figure is the system's.
MFU = model FLOPs (megascale.diagnostics.mfu: real SWA span, no recomputation) x tokens/s /
the peak the trainer uses (data sheet on a GPU); with no known peak, no MFU.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import tempfile
import time
import traceback
from dataclasses import replace
from datetime import date
from pathlib import Path

import numpy as np
import torch

from megascale.config import JobConfig, ModelConfig
from megascale.data.shards import ShardWriter, dtype_for_vocab
from megascale.diagnostics.mfu import device_peak_flops, mfu
from megascale.model import GPT
from megascale.model.attention import flex_attention, sdpa_attention
from megascale.model.efficiency import (
    apply_compile,
    apply_recompute,
    fuse_parallel_gemms,
    set_attention_kernel,
)
from megascale.model.flops import flops_per_token, parameter_count
from megascale.train.trainer import Trainer

MODELS = {
    "1.3B": ModelConfig(vocab_size=50304, seq_len=2048, layers=24, hidden=2048, heads=16),
    "2.7B": ModelConfig(vocab_size=50304, seq_len=2048, layers=32, hidden=2560, heads=32),
}
TINY = ModelConfig(vocab_size=512, seq_len=128, layers=2, hidden=64, heads=4)
SWA_WINDOW = 512


# (size, block, SWA, compiled) in the order they run: each contrast the issue asks for (size,
# SWA, block, compile) appears within the first five, so a budget cut loses repeats, not a
# dimension. 2.7B runs compiled only (its eager figures would not change the ceiling).
ORDER = [
    ("1.3B", "parallel", False, True),
    ("2.7B", "parallel", False, True),
    ("1.3B", "parallel", True, True),
    ("1.3B", "serial", False, True),
    ("1.3B", "parallel", False, False),
    ("2.7B", "parallel", True, True),
    ("2.7B", "serial", False, True),
    ("1.3B", "serial", True, True),
    ("1.3B", "parallel", True, False),
    ("1.3B", "serial", False, False),
    ("1.3B", "serial", True, False),
    ("2.7B", "serial", True, True),
]


def variants(dry_run: bool) -> list[tuple[str, ModelConfig, bool, bool]]:
    """(name, model, compile, fused input GEMM) in run order. A dry run goes through the code
    paths once, with one tiny model standing in for the 1.3B."""
    out = []
    for size, block, swa, compiled in ORDER:
        if dry_run and size != "1.3B":
            continue
        base = TINY if dry_run else MODELS[size]
        window = (32 if dry_run else SWA_WINDOW) if swa else None
        span = f"swa{window}" if window else "full"
        name = f"{'tiny' if dry_run else size} {block} {span} {'compile' if compiled else 'eager'}"
        out.append((name, replace(base, block=block, window=window), compiled, block == "parallel"))
    return out


def check_parity(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Each fused path against its reference on random inputs: FlexAttention's max abs
    difference from SDPA, and for the model transformations the relative difference of the
    loss and of the gradients (max |diff| / max |grad|) from the eager model on SDPA."""
    torch.manual_seed(0)
    results = {}
    q, k, v = (torch.randn(2, 4, 1024, 64, device=device, dtype=dtype) for _ in range(3))
    for window in (None, 256):
        ref = sdpa_attention(q.float(), k.float(), v.float(), window)
        results[f"flex_vs_sdpa_window_{window}"] = (flex_attention(q, k, v, window).float() - ref).abs().max().item()
    cfg = replace(TINY, block="parallel", window=32)
    base = GPT(cfg, seed=0).to(device)
    set_attention_kernel(base, "sdpa")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), device=device)
    ref_loss, ref_grads = _loss_and_grads(base, tokens)
    for name, transform, kernel in (
        ("fused_input_gemm", fuse_parallel_gemms, "sdpa"),
        ("compile", apply_compile, "sdpa"),
        ("compile_flex", apply_compile, "flex"),  # how a compiled block runs SWA on a GPU
        ("recompute_full", lambda b: apply_recompute(b, "full"), "sdpa"),
        ("recompute_selective", lambda b: apply_recompute(b, "selective"), "sdpa"),
    ):
        other = copy.deepcopy(base)
        set_attention_kernel(other, kernel)
        transform(other.blocks)
        with_grads = kernel == "sdpa" or device.type == "cuda"  # FlexAttention has no CPU backward
        loss, grads = _loss_and_grads(other, tokens, with_grads)
        diff = abs(loss - ref_loss) / abs(ref_loss)
        for n, g in grads.items():
            diff = max(diff, (g - ref_grads[n]).abs().max().item() / ref_grads[n].abs().max().clamp_min(1e-12).item())
        results[name] = diff
    if device.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = _loss_and_grads(base, tokens, with_grads=False)
        results["bf16_autocast_rel"] = abs(loss - ref_loss) / abs(ref_loss)
    return results


def _loss_and_grads(model: GPT, tokens: torch.Tensor, with_grads: bool = True) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(with_grads):
        loss = model(tokens, tokens) / tokens.numel()
    if not with_grads:
        return loss.item(), {}
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def gemm_ceiling(device: torch.device, dtype: torch.dtype, size: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps = 20 if device.type == "cuda" else 3
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - start)


def synthetic_dataset(root: Path, vocab_size: int, tokens: int) -> Path:
    """Uniform random tokens in the prepared-dataset format, so variants train through the real
    data loader (the speed of a step does not depend on what the tokens say)."""
    rng = np.random.default_rng(0)
    writer = ShardWriter(root, dtype_for_vocab(vocab_size), eod=vocab_size - 1)
    for _ in range(8):  # a few documents, so the loader sees end-of-document tokens
        writer.add(rng.integers(0, vocab_size - 1, tokens // 8))
    writer.finish(
        {"kind": "synthetic", "name": "uniform-random", "vocab_size": vocab_size, "eod": vocab_size - 1},
        {"kind": "bench/gpu/run.py", "seed": 0},
    )
    return root


def job_config(
    model: ModelConfig,
    compiled: bool,
    fused: bool,
    device: torch.device,
    micro_batch: int,
    accum: int,
    steps: int,
    data: Path,
    run_dir: Path,
) -> JobConfig:
    """One GPU, `accum` micro-batches per step (as in real training, the optimizer step is shared
    by several of them), no checkpoints or evaluation: only training steps are timed."""
    cfg = JobConfig(
        model=model,
        data=replace(JobConfig().data, path=str(data), verify_checksums=False),
        train=replace(
            JobConfig().train,
            steps=steps,
            global_batch=micro_batch * accum,
            micro_batch=micro_batch,
            device=device.type,
            dtype="bf16" if device.type == "cuda" else "fp32",
            compile=compiled,
            fuse_input_gemm=fused,
            eval_every=0,
            log_every=steps,
            gc_every=0,
            run_dir=str(run_dir),
            tensorboard=False,
        ),
        checkpoint=replace(JobConfig().checkpoint, every=0, resume="none"),
    )
    cfg.validate()
    return cfg


def train_mfu(cfg: JobConfig, warmup: int) -> dict:
    """Train with megascale's own `Trainer` (optimizer, clipping, timers and all) and report the
    steps after `warmup` (which absorb compilation and allocator growth)."""
    trainer = Trainer(cfg)
    try:
        for _ in range(warmup):
            trainer.run_step()
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)
        records = [trainer.run_step() for _ in range(cfg.train.steps - warmup)]
        peak_mem = torch.cuda.max_memory_allocated(trainer.device) / 2**30 if trainer.device.type == "cuda" else None
        peak = trainer.peak
    finally:
        trainer.close()
        del trainer
        gc.collect()
        torch._dynamo.reset()  # variants share code objects: never hit the recompile limit
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    step_s = sum(r["step_time"] for r in records) / len(records)
    tokens_per_s = cfg.train.global_batch * cfg.model.seq_len / step_s
    flops = flops_per_token(cfg.model).training
    return {
        "params_b": parameter_count(cfg.model) / 1e9,
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * flops / 1e12,
        "mfu": mfu(tokens_per_s, flops, peak.value),
        "peak_source": peak.source,
        "step_s": step_s,
        "time_by_kind_s": {
            k[5:]: sum(r[k] for r in records) / len(records) for k in records[-1] if k.startswith("time_")
        },
        "final_loss": records[-1]["loss"],
        "peak_mem_gib": peak_mem,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny models on CPU")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting variants after this")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation) per variant")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--only", default="", help="run only variants whose name contains this")
    args = parser.parse_args()
    begin = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    report: dict = {
        "date": date.today().isoformat(),
        "device": name,
        "torch": torch.__version__,
        "dtype": str(dtype),
        "peak_flops": device_peak_flops(name, "bf16") if cuda else None,
        "dry_run": args.dry_run,
        "micro_batch": args.micro_batch if cuda else 2,
        "accum": args.accum if cuda else 2,
        "timed_steps": args.steps if cuda else 2,
        "variants": {},
    }
    print(f"parity checks on {name} ...", flush=True)
    report["parity"] = check_parity(device, dtype)
    report["gemm_ceiling_tflops"] = gemm_ceiling(device, dtype, 8192 if cuda else 512) / 1e12
    with tempfile.TemporaryDirectory(prefix="megascale-gpu-bench-") as work:
        steps = args.warmup + report["timed_steps"]
        data = synthetic_dataset(
            Path(work) / "data",
            (TINY if args.dry_run else MODELS["1.3B"]).vocab_size,
            tokens=(steps * report["micro_batch"] * report["accum"] + 16)
            * (max(m.seq_len for m in MODELS.values()) + 1),
        )
        for label, model, compiled, fused in variants(args.dry_run):
            if args.only not in label:
                report["variants"][label] = {"skipped": f"not selected by --only {args.only!r}"}
                continue
            if time.perf_counter() - begin > args.budget_s:
                report["variants"][label] = {"skipped": "time budget"}
                continue
            print(f"variant {label} ...", flush=True)
            cfg = job_config(
                model,
                compiled,
                fused,
                device,
                report["micro_batch"],
                report["accum"],
                steps,
                data,
                Path(work) / "runs" / label.replace(" ", "_"),
            )
            try:
                report["variants"][label] = train_mfu(cfg, args.warmup)
            except Exception as exc:  # out of memory, a kernel this GPU lacks: the next variant still runs
                traceback.print_exc()
                report["variants"][label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    report["total_s"] = time.perf_counter() - begin
    out_dir = Path(os.environ.get("OUT") or "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / ("gpu_dry_run.json" if args.dry_run else "gpu_bench.json")
    out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {out}")


def print_table(report: dict) -> None:
    print(f"\n{report['device']}  torch {report['torch']}  {report['dtype']}")
    print(
        "parity (flex: max abs diff; transformations: rel diff of loss and gradients): "
        + ", ".join(f"{k}={v:.2e}" for k, v in report["parity"].items())
    )
    print(f"GEMM ceiling: {report['gemm_ceiling_tflops']:.1f} TFLOP/s")
    print(f"{'variant':38} {'params':>7} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8}")
    for label, row in report["variants"].items():
        if "tokens_per_s" not in row:
            print(f"{label:38} {row.get('skipped') or row.get('error')}")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        mem = f"{row['peak_mem_gib']:.1f}" if row["peak_mem_gib"] is not None else "n/a"
        print(f"{label:38} {row['params_b']:6.2f}B {row['tokens_per_s']:10.0f} {row['tflops']:8.1f} {mfu:>6} {mem:>8}")


if __name__ == "__main__":
    main()
