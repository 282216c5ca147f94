"""One-script single-GPU efficiency check (issue 12): parity of every fused path, the GEMM
ceiling, and training MFU of ~1.3B and ~2.7B GPTs (serial vs parallel block, full vs SWA,
compile on/off). Fits an 8-minute budget on one H200: variants that would not fit are listed
as skipped, never guessed. Prints a table last and writes JSON to $OUT (or bench/results).

    python bench/gpu/run.py                 # on a GPU
    python bench/gpu/run.py --dry-run       # tiny models on CPU: exercises every code path

MFU = model FLOPs (megascale.diagnostics.mfu: real SWA span, no recomputation) x tokens/s /
peak of the device's dtype from the data-sheet table; with no known peak, no MFU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch

from megascale.config import ModelConfig
from megascale.diagnostics.mfu import device_peak_flops, flops_per_token, parameter_count
from megascale.model import GPT
from megascale.model.attention import flex_attention, sdpa_attention
from megascale.model.efficiency import apply_compile, apply_recompute, fuse_parallel_input_gemm

MODELS = {
    "1.3B": ModelConfig(vocab_size=50304, seq_len=2048, layers=24, hidden=2048, heads=16),
    "2.7B": ModelConfig(vocab_size=50304, seq_len=2048, layers=32, hidden=2560, heads=32),
}
TINY = ModelConfig(vocab_size=512, seq_len=128, layers=2, hidden=64, heads=4)
SWA_WINDOW = 512


def variants(dry_run: bool) -> list[tuple[str, ModelConfig, bool, bool]]:
    """(name, model, compile, fused input GEMM) in the order they run: most informative first."""
    out = []
    for size in ("1.3B", "2.7B"):
        base = TINY if dry_run else MODELS[size]
        window = 32 if dry_run else SWA_WINDOW
        for block in ("parallel", "serial"):
            for win in (None, window):
                for compiled in (True, False):
                    if size == "2.7B" and not compiled:
                        continue  # keep within budget: the compiled 2.7B runs tell the ceiling
                    cfg = replace(base, block=block, window=win)
                    span = f"swa{win}" if win else "full"
                    mode = "compile" if compiled else "eager"
                    name = f"{'tiny' if dry_run else size} {block} {span} {mode}"
                    out.append((name, cfg, compiled, block == "parallel"))
    return out


def check_parity(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Max abs difference of each fused path against its reference on random inputs."""
    torch.manual_seed(0)
    results = {}
    q, k, v = (torch.randn(2, 4, 1024, 64, device=device, dtype=dtype) for _ in range(3))
    for window in (None, 256):
        ref = sdpa_attention(q.float(), k.float(), v.float(), window)
        results[f"flex_vs_sdpa_window_{window}"] = (flex_attention(q, k, v, window).float() - ref).abs().max().item()
    cfg = replace(TINY, block="parallel", window=32)
    base = GPT(cfg).to(device)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), device=device)
    ref_loss = base(tokens, tokens).item()
    for name, transform in (
        ("fused_input_gemm", fuse_parallel_input_gemm),
        ("compile", apply_compile),
        ("recompute_full", lambda b: apply_recompute(b, "full")),
        ("recompute_selective", lambda b: apply_recompute(b, "selective")),
    ):
        other = copy.deepcopy(base)
        transform(other.blocks)
        results[name] = abs(other(tokens, tokens).item() - ref_loss) / abs(ref_loss)
    if device.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results["bf16_autocast_rel"] = abs(base(tokens, tokens).item() - ref_loss) / abs(ref_loss)
    return results


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


def train_mfu(cfg: ModelConfig, compiled: bool, fused: bool, device: torch.device, micro_batch: int,
              steps: int, peak: float | None) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if fused:
        fuse_parallel_input_gemm(model.blocks)
    if compiled:
        apply_compile(model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = model(tokens, tokens) / tokens.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(2):  # warm-up (and compilation)
        step()
    _sync(device)
    warm = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = micro_batch * cfg.seq_len * steps / elapsed
    flops = flops_per_token(cfg).training
    return {
        "params_b": parameter_count(cfg) / 1e9,
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * flops / 1e12,
        "mfu": tokens_per_s * flops / peak if peak else None,
        "step_s": elapsed / steps,
        "warmup_s": warm,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny models on CPU")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting variants after this")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    begin = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    peak = device_peak_flops(name, "bf16") if cuda else None
    report: dict = {
        "date": date.today().isoformat(), "device": name, "torch": torch.__version__,
        "dtype": str(dtype), "peak_flops": peak, "dry_run": args.dry_run, "variants": {},
    }
    report["parity"] = check_parity(device, dtype)
    report["gemm_ceiling_tflops"] = gemm_ceiling(device, dtype, 8192 if cuda else 512) / 1e12
    micro_batch = args.micro_batch if cuda else 2
    steps = args.steps if cuda else 2
    for label, cfg, compiled, fused in variants(args.dry_run):
        if time.perf_counter() - begin > args.budget_s:
            report["variants"][label] = {"skipped": "time budget"}
            continue
        try:
            report["variants"][label] = train_mfu(cfg, compiled, fused, device, micro_batch, steps, peak)
        except torch.cuda.OutOfMemoryError as exc:
            report["variants"][label] = {"error": f"out of memory: {exc}"[:200]}
            torch.cuda.empty_cache()
    report["total_s"] = time.perf_counter() - begin
    out_dir = Path(os.environ.get("OUT") or "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / ("gpu_dry_run.json" if args.dry_run else "gpu_bench.json")
    out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {out}")


def print_table(report: dict) -> None:
    print(f"\n{report['device']}  torch {report['torch']}  {report['dtype']}")
    print("parity (max abs diff / rel loss diff): " + ", ".join(f"{k}={v:.2e}" for k, v in report["parity"].items()))
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
