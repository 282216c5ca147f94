"""What the driver calls while a job runs: ingest new timer records, raise straggler alerts,
and, on a fault, attach the hang analysis to the fault's record.

Why a separate entry point: the driver polls every few seconds, so it keeps one `Collector`
(incremental reads) instead of rebuilding the whole report; the HTML report stays a
`megascale report` affair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megascale.config.schema import DiagnosticsConfig
from megascale.diagnostics import hang
from megascale.diagnostics.store import Collector
from megascale.diagnostics.straggler import find_stragglers


class LiveDiagnostics:
    """Incremental view of a running job's diagnostics."""

    def __init__(self, run_dir: str | Path, cfg: DiagnosticsConfig | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg or DiagnosticsConfig()
        self.collector = Collector(run_dir)

    def poll(self) -> dict[str, Any]:
        """Ingest what the ranks wrote since the last call; the status the driver shows."""
        new = self.collector.poll()
        c = self.cfg
        stragglers = find_stragglers(self.collector.conn, c.straggler_threshold,
                                     c.straggler_min_fraction,
                                     warmup_steps=c.straggler_warmup_steps)
        return {"new_spans": new, "stragglers": [s.to_dict() for s in stragglers],
                "alerts": [f"straggler: {s.describe()}" for s in stragglers]}

    def hang_record(self) -> dict[str, Any] | None:
        """The hang analysis to attach to a fault, or None when no rank dumped."""
        analysis = hang.analyse(self.run_dir)
        return analysis.to_dict() if analysis is not None else None

    def close(self) -> None:
        self.collector.close()
