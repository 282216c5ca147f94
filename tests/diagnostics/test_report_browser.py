"""The HTML report renders in a real headless Chromium, images included, without network."""

from __future__ import annotations

import time

import numpy as np
import pytest

from megascale.diagnostics.report import build_report
from megascale.diagnostics.timers import Timers
from tests.diagnostics.browser import needs_chromium, run_chromium

pytestmark = [pytest.mark.timeout(120), needs_chromium]


def fake_run(run_dir, slow_rank: int = 1) -> None:
    """Four ranks' timer files written by real Timers; one rank computes 3x longer."""
    timers = [Timers(r, {"pp": 0, "dp": r // 2, "tp": r % 2}, f"node{r // 2}", run_dir) for r in range(4)]
    for step in range(6):
        for r, t in enumerate(timers):
            now = time.perf_counter()
            compute = 0.003 * (3 if r == slow_rank else 1)
            t.record("forward", "compute", now, now + compute)
            t.record("all_reduce", "comm", now + compute, now + 0.01, op="all_reduce", group="dp")
            t.end_step(step)
    for t in timers:
        t.close()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(6):
            f.write(
                f'{{"step": {step}, "loss": {3 - step / 10}, "mfu": 0.4, "tokens_per_s": 1e4, "step_time": 0.01}}\n'
            )


def test_report_renders_in_headless_chromium(tmp_path) -> None:
    fake_run(tmp_path)
    report = build_report(tmp_path)
    assert [s.rank for s in report.stragglers] == [1]
    shot = tmp_path / "shot.png"
    proc = run_chromium(report.html, tmp_path / "profile", "--window-size=1400,2400", f"--screenshot={shot}")
    assert shot.is_file(), proc.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1400)
    # the heat maps' red row (the slow rank) and the blue bars are on screen: images loaded
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    red = (r > 0.3) & (r > 2.5 * g) & (r > 2 * b)
    blue = (b > 0.5) & (r < 0.3)
    assert red.sum() > 2000 and blue.sum() > 2000, (red.sum(), blue.sum())
    assert len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50
