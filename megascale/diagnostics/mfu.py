"""Peak FLOP/s and MFU, so that MFU is honest.

Model FLOPs per token come from the model (`megascale.model.flops`). Peak FLOP/s comes from a
table of known devices or, on CPU, from a GEMM probe measured on this machine. With no known
peak there is no MFU: `peak_flops()` returns a `Peak` whose value is None and callers print none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# Dense (no sparsity) peak FLOP/s from the vendors' data sheets, per dtype.
# fp32 on A100/H100/H200 means plain FP32 (not TF32) since we do not enable TF32.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
}


def device_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak for a known accelerator name (e.g. 'NVIDIA H200'), else None."""
    for key, table in PEAK_FLOPS.items():
        if key in device_name.upper():
            return table.get(dtype)
    return None


def measure_cpu_gemm_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """Best sustained fp32 GEMM FLOP/s of this CPU with torch's current thread count."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * size**3 / elapsed)
    return best


@dataclass
class Peak:
    """Peak FLOP/s of the device training runs on, and where the figure came from.

    A measured (CPU) peak is a maximum: a probe that ran while other processes held the cores
    reads low and would inflate MFU, so `refresh()` measures again and can only raise it, and
    `observe()` raises it to what training itself achieved (a lower bound on any peak): a
    measured peak never gives an MFU above 100%."""

    value: float | None
    source: str
    measured: bool = False

    def refresh(self) -> None:
        if self.measured:
            self.value = _remember(max(self.value or 0.0, measure_cpu_gemm_flops(seconds=0.3)))

    def observe(self, achieved_flops: float) -> bool:
        """Raise a measured peak that training exceeded; True when it did."""
        if not self.measured or achieved_flops <= (self.value or 0.0):
            return False
        self.value = _remember(achieved_flops)
        return True


_cpu_peak: dict[int, float] = {}  # threads -> best figure in this process (a rank that lives on keeps it)


def _remember(value: float) -> float:
    threads = torch.get_num_threads()
    _cpu_peak[threads] = max(_cpu_peak.get(threads, 0.0), value)
    return value


def peak_flops(device: torch.device, dtype: str) -> Peak:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = device_peak_flops(name, dtype)
        return Peak(peak, f"table:{name}" if peak else f"unknown device {name!r}: no MFU")
    if device.type == "cpu" and dtype == "fp32":
        known = _cpu_peak.get(torch.get_num_threads())  # a later trainer of this process: no new probe
        value = known if known is not None else _remember(measure_cpu_gemm_flops())
        return Peak(value, "measured CPU GEMM probe, best so far", measured=True)
    return Peak(None, f"no known peak for {device.type}/{dtype}: no MFU")


def mfu(tokens_per_second: float, flops_per_token_training: float, peak: float | None) -> float | None:
    if not peak:
        return None
    return tokens_per_second * flops_per_token_training / peak
