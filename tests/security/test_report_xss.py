"""A crafted run whose timer files carry script in their coordinates and host names: the report
renders in headless Chromium and none of it runs (the page's title would say so)."""

from __future__ import annotations

import time

import pytest

from megascale.diagnostics.report import build_report
from megascale.diagnostics.timers import Timers
from tests.diagnostics.browser import needs_chromium, run_chromium

pytestmark = [pytest.mark.timeout(120), needs_chromium]
# Each payload, if it ran, would change the title to one the page's own text does not contain.
PAYLOADS = {
    "pp": "<script>document.title = 'PW' + 'NED:pp'</script>",
    "host": "<img src=x onerror=\"document.title = 'PW' + 'NED:host'\">",
    "tp": "</td></tr></table><svg onload=\"document.title = 'PW' + 'NED:tp'\">",
}


def test_report_of_a_crafted_run_runs_no_injected_script(tmp_path):
    timers = [
        Timers(r, {"pp": PAYLOADS["pp"], "dp": r, "tp": PAYLOADS["tp"]}, f"{PAYLOADS['host']}{r}", tmp_path)
        for r in range(2)
    ]
    for step in range(4):
        for t in timers:
            now = time.perf_counter()
            t.record("forward", "compute", now, now + 0.002 * (1 + t.rank))
            t.end_step(step)
    for t in timers:
        t.close()
    report = build_report(tmp_path)
    page = report.html.read_text()
    assert "&lt;script&gt;document.title" in page  # the value is on the page, as text
    dom = run_chromium(report.html, tmp_path / "profile", "--virtual-time-budget=2000", "--dump-dom")
    assert "<title>megascale report</title>" in dom.stdout, dom.stderr[-2000:]
    assert "PWNED" not in dom.stdout
    assert "<script" not in page and "<img src=x" not in page and "<svg" not in page
