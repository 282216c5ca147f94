"""Peaks: MFU is honest or absent."""

import pytest
import torch

from megascale.diagnostics.mfu import Peak, device_peak_flops, mfu, peak_flops


def test_known_and_unknown_peaks():
    assert device_peak_flops("NVIDIA H200", "bf16") == 989e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert device_peak_flops("Some Future GPU", "bf16") is None
    assert mfu(1000.0, 1e9, None) is None
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert peak_flops(torch.device("cpu"), "bf16").value is None


def test_measured_peak_only_rises():
    peak = peak_flops(torch.device("cpu"), "fp32")
    assert peak.measured and peak.value > 0
    peak.value = 1.0  # as if the first probe had been starved of CPU
    peak.refresh()
    assert peak.value > 1.0
    fixed = Peak(5.0, "table")
    fixed.refresh()
    assert fixed.value == 5.0
