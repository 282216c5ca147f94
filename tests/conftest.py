"""Test order: the longest files first, by the seconds recorded in tests/durations.json.

scripts/test.sh hands whole files to the pytest-xdist workers in collection order
(`--dist loadfile --no-loadscope-reorder`). The multi-process files take minutes each; started
last, one of them runs on while the other workers have nothing left. Started first, the many
short files fill in beside them. A file not in the record goes last.

    MEGASCALE_RECORD_DURATIONS=1 bash scripts/test.sh   # rewrites the record for the files run
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("durations.json")  # {"tests/x/test_y.py": seconds, ...}
_seconds: Counter[str] = Counter()


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    items.sort(key=lambda item: -recorded.get(_file(item.nodeid), 0.0))  # stable: a file keeps its order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[_file(report.nodeid)] += report.duration  # setup, call and teardown


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not os.environ.get("MEGASCALE_RECORD_DURATIONS") or hasattr(session.config, "workerinput"):
        return  # only the controller writes (xdist forwards every worker's reports to it)
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    recorded.update({name: round(s, 1) for name, s in _seconds.items()})
    RECORD.write_text(json.dumps(dict(sorted(recorded.items(), key=lambda kv: -kv[1])), indent=0) + "\n")
