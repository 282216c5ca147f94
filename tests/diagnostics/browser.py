"""Headless Chromium for the report's tests: found once, started with one set of flags.

The flags keep a test's browser offline and to itself: no sandbox (CI runs as root), no GPU, no
background networking, component updates, sync or first-run pages, and a profile of its own
under the test's temporary directory. Each test adds what it looks at (a screenshot, the DOM).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (run scripts/install_chromium.sh)")
OFFLINE_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
)


def run_chromium(page: Path, profile: Path, *flags: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Open `page` in headless Chromium with `flags` after the offline ones; text output."""
    assert CHROMIUM is not None
    cmd = [CHROMIUM, *OFFLINE_FLAGS, f"--user-data-dir={profile}", *flags, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
