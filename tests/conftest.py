"""Test order for the pytest-xdist workers: files marked `long_file` first, the rest by their
number of tests, most first (what pytest-xdist's own reordering does).

scripts/test.sh hands whole files to the workers in this order (`--dist loadfile
--no-loadscope-reorder`). A file of a few long tests (the fault matrix: ~7 minutes of real jobs)
came late in xdist's order and ran on alone after the other workers were done. Only the longest
file is marked: starting every multi-process file at once made them compete for the cores, each
twice as slow. (Beside the fail-slow job the five-fault job's last fault once restored from peer
memory, not storage: a peer copy still in flight escaped the `corrupt` fault; that fault now
waits for it, `Trainer.replicas`.)
"""

from __future__ import annotations

from collections import Counter

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    count = Counter(item.path for item in items)
    first = {item.path for item in items if item.get_closest_marker("long_file")}
    items.sort(key=lambda item: (item.path not in first, -count[item.path]))  # stable within a file
