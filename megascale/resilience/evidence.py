"""What the diagnostics package can add to a fault or an alert: the hang analysis (which rank
is stuck, from the ranks' watchdog dumps) and the stragglers (ranks slower in compute than their
stage peers, from the per-rank timers). Best effort: a missing or torn file yields nothing."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megascale.config.schema import JobConfig

log = logging.getLogger("megascale.driver")


def hang_evidence(run_dir: str | Path, layout: dict[str, int]) -> dict[str, Any] | None:
    from megascale.diagnostics.hang import analyse
    from megascale.parallel.grid import RankGrid

    try:
        analysis = analyse(run_dir, RankGrid(layout["pp"], layout["dp"], layout["tp"]))
    except (OSError, ValueError, KeyError) as exc:
        log.warning("hang analysis unavailable: %s", exc)
        return None
    return None if analysis is None else {"stuck": analysis.stuck, "summary": analysis.summary()}


def straggler_evidence(run_dir: str | Path, cfg: JobConfig) -> list[dict[str, Any]]:
    from megascale.diagnostics.store import Collector
    from megascale.diagnostics.straggler import find_stragglers

    d = cfg.diagnostics
    try:
        collector = Collector(run_dir, Path(run_dir) / "resilience" / "diagnostics.sqlite")
        try:
            collector.poll()
            found = find_stragglers(collector.conn, d.straggler_threshold, d.straggler_min_fraction,
                                    warmup_steps=d.straggler_warmup_steps)
        finally:
            collector.close()
    except Exception as exc:  # diagnostics must never take the driver down
        log.warning("straggler analysis unavailable: %s", exc)
        return []
    return [dict(s.to_dict(), description=s.describe()) for s in found]
