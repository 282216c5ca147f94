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


def test_a_measured_peak_is_never_below_what_training_reached():
    """A probe starved of CPU at start-up would give an MFU above 100%: the achieved model
    FLOP/s is a lower bound on the peak, so the measured peak rises to it (a table peak stays)."""
    probe = Peak(10e9, "measured", measured=True)
    assert not probe.observe(8e9) and probe.value == 10e9
    assert probe.observe(12e9) and probe.value == 12e9
    assert mfu(12e9 / 6e6, 6e6, probe.value) == pytest.approx(1.0)
    table = Peak(10e9, "table")
    assert not table.observe(12e9) and table.value == 10e9
