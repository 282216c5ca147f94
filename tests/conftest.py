"""The longest test files first, so that `--dist loadfile` never starts one of them last.

xdist hands files to its workers in collection order; a 10-minute file that comes last keeps one
worker busy while the others idle, and the suite's wall time is what CI limits. The list holds
the files whose tests took longest in scripts/test.sh's `--durations` output (2-core machine,
their tests summed), longest first; a file not listed keeps its place after them, and a listed
file that was renamed only loses its place.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "tests/resilience/test_faults.py",  # ~600 s: fault-injection jobs, one after the other
    "tests/parallel/test_layouts.py",
    "tests/checkpoint/test_checkpoint_layouts.py",
    "tests/parallel/test_zero.py",
    "tests/train/test_stop.py",
    "tests/checkpoint/test_expert_checkpoints.py",
    "tests/diagnostics/test_train_e2e.py",
    "tests/parallel/test_context_parallel_train.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def place(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=place)  # stable: a file's tests, and the other files, keep their order
