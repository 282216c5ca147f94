"""The driver's live straggler evidence costs the same however long the run, and the same per
rank from 128 to 512 ranks; it still names the slow rank.

The timer files and step summaries are written by the real `Timers` (megascale.testing.simtraces);
the evidence is the function the driver's evidence child runs. At 12,288 ranks and 5 steps it
ingested every span through the collector (31 s CPU, 265 s wall under load: past its 120 s
timeout, so the driver got nothing). Costs are this thread's CPU time, the sizes side by side in
one test, so a loaded machine shifts them alike.
"""

from __future__ import annotations

import pytest

from megascale.config import load_config
from megascale.config.loader import dump_config
from megascale.layout.grid import RankGrid
from megascale.resilience.driver import evidence
from megascale.testing.simtraces import TraceShape, write_timer_files
from tests.diagnostics.test_scale import cpu

pytestmark = [pytest.mark.serial, pytest.mark.timeout(300)]  # CPU-cost ratios: run alone (scripts/test.sh)


def test_live_straggler_evidence_is_flat_in_run_length_and_per_rank(tmp_path) -> None:
    config = tmp_path / "config.toml"
    dump_config(load_config(None, []), config)  # 8-step windows: the evidence reads 16 steps
    costs = {}
    for dp, steps in ((4, 20), (4, 80), (16, 20)):
        grid = RankGrid(pp=4, dp=dp, tp=8)
        slow = grid.rank_of(2, dp - 1, 5)
        run = tmp_path / f"dp{dp}_s{steps}"
        write_timer_files(run, TraceShape(grid, steps=steps, micro_batches=1, slow_rank=slow, slow_factor=1.3))
        runs = [cpu(lambda r=run: evidence._stragglers(str(r), str(config))) for _ in range(3)]
        costs[(grid.world_size, steps)] = min(c for c, _ in runs)  # noise only adds CPU: the least of 3
        found = runs[0][1]
        assert [s["rank"] for s in found] == [slow], (dp, steps, found)
        assert found[0]["steps"] == 15, found  # the newest 16 steps, the first left out as warm-up
    small = costs[(128, 20)]
    assert costs[(128, 80)] < 1.5 * small, costs  # the collector's ingest: 4x the spans, ~4x the CPU
    assert costs[(512, 20)] / 4 < 2.0 * small, costs
