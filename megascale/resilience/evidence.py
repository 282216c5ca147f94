"""What the diagnostics package can add to a fault or an alert: the hang analysis (which rank
is stuck, from the ranks' watchdog dumps) and the stragglers (ranks slower in compute than their
stage peers, from the per-rank timers).

Each runs in a child process: the diagnostics import torch, and seconds of import inside the
driver would hold up every heartbeat it must answer. Best effort: any failure yields nothing.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("megascale.driver")
TIMEOUT_S = 120


def hang_evidence(run_dir: str | Path, layout: dict[str, int]) -> dict[str, Any] | None:
    return _child(["hang", str(run_dir), json.dumps(layout)])


def straggler_evidence(run_dir: str | Path, config_path: str | Path) -> list[dict[str, Any]]:
    return _child(["stragglers", str(run_dir), str(config_path)]) or []


def _child(args: list[str]) -> Any:
    try:
        out = subprocess.run([sys.executable, "-m", "megascale.resilience.evidence", *args],
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        log.warning("%s evidence unavailable: %s", args[0], exc)
        return None


def _hang(run_dir: str, layout: dict[str, int]) -> dict[str, Any] | None:
    from megascale.diagnostics.hang import analyse
    from megascale.layout.grid import RankGrid

    analysis = analyse(run_dir, RankGrid(layout["pp"], layout["dp"], layout["tp"]))
    return None if analysis is None else {"stuck": analysis.stuck, "summary": analysis.summary()}


def _stragglers(run_dir: str, config_path: str) -> list[dict[str, Any]]:
    from megascale.config import load_config
    from megascale.diagnostics.store import Collector
    from megascale.diagnostics.straggler import find_stragglers

    d = load_config(config_path).diagnostics
    collector = Collector(run_dir, Path(run_dir) / "resilience" / "diagnostics.sqlite")
    try:
        collector.poll()
        found = find_stragglers(collector.conn, d.straggler_threshold, d.straggler_min_fraction,
                                warmup_steps=d.straggler_warmup_steps)
    finally:
        collector.close()
    return [dict(s.to_dict(), description=s.describe()) for s in found]


if __name__ == "__main__":
    kind, run_dir, extra = sys.argv[1:4]
    result = _hang(run_dir, json.loads(extra)) if kind == "hang" else _stragglers(run_dir, extra)
    print(json.dumps(result, default=str))
