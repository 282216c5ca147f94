"""The run's analytical store: every rank's spans and the per-step metrics in one SQLite file.

Why SQLite: it ships with Python, is embedded (one file next to the run, no server) and answers
the group-by queries the analysers need in milliseconds for millions of spans. Ingestion is
incremental: the byte offset read so far of each per-rank file is stored with the rows in the
same transaction, so `Collector.poll()` can run every few seconds while a job trains (the
driver's live path) and `megascale report` afterwards picks up exactly what is new.

Schema (also in docs/troubleshooting.md):
  spans(step, rank, host, pp, dp, tp, name, kind, start, dur, self, attrs)
      one row per timed span; start in epoch seconds, dur/self in seconds; self = dur minus
      nested spans; kind 'step' rows carry the step's wall time; attrs is JSON.
  metrics(step, loss, tokens_per_s, mfu, step_time, raw)   one row per metrics.jsonl line.
  rank_steps (view): step, rank, host, pp, dp, tp, compute, comm, p2p, data, optimizer,
      other, step_time -- per-kind self-time totals of each rank in each step.
  ingested(file, offset)   bookkeeping for incremental reads.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megascale.diagnostics.timers import KINDS

SCHEMA = """
CREATE TABLE IF NOT EXISTS spans(
    step INTEGER, rank INTEGER, host TEXT, pp INTEGER, dp INTEGER, tp INTEGER,
    name TEXT, kind TEXT, start REAL, dur REAL, self REAL, attrs TEXT);
CREATE INDEX IF NOT EXISTS spans_step_rank ON spans(step, rank);
CREATE TABLE IF NOT EXISTS metrics(
    step INTEGER PRIMARY KEY, loss REAL, tokens_per_s REAL, mfu REAL, step_time REAL, raw TEXT);
CREATE TABLE IF NOT EXISTS ingested(file TEXT PRIMARY KEY, offset INTEGER);
CREATE VIEW IF NOT EXISTS rank_steps AS
SELECT step, rank, MIN(host) AS host, MIN(pp) AS pp, MIN(dp) AS dp, MIN(tp) AS tp,
{kinds},
    MAX(CASE WHEN kind = 'step' THEN dur END) AS step_time
FROM spans GROUP BY step, rank;
""".format(kinds=",\n".join(f"    SUM(CASE WHEN kind = '{k}' THEN self ELSE 0 END) AS {k}" for k in KINDS))

_METRIC_KEYS = ("loss", "tokens_per_s", "mfu", "step_time")


def default_db_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "diagnostics" / "diagnostics.sqlite"


def connect(path: str | Path) -> sqlite3.Connection:
    """Open (creating if needed) a store with the schema above."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=30)
    conn.row_factory = sqlite3.Row
    conn.executescript(SCHEMA)
    return conn


def span_row(rec: dict[str, Any]) -> tuple:
    coords = rec.get("coords") or {}
    return (
        rec["step"],
        rec["rank"],
        rec.get("host", ""),
        coords.get("pp", 0),
        coords.get("dp", 0),
        coords.get("tp", 0),
        rec["name"],
        rec["kind"],
        rec["start"],
        rec["dur"],
        rec.get("self", rec["dur"]),
        json.dumps(rec.get("attrs") or {}, default=str),
    )


class Collector:
    """Gathers a run's per-rank timer files and metrics into the store, incrementally."""

    def __init__(self, run_dir: str | Path, db_path: str | Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.db_path = Path(db_path) if db_path else default_db_path(run_dir)
        self.conn = connect(self.db_path)

    def poll(self) -> int:
        """Read what was appended since the last call; returns the number of new spans.

        One transaction for the whole poll: a commit per rank file was 12,288 disk syncs at
        MegaScale's size, longer than the driver waits for its straggler evidence.
        """
        new = 0
        with self.conn:
            offsets = dict(self.conn.execute("SELECT file, offset FROM ingested").fetchall())
            for path in sorted((self.run_dir / "timers").glob("rank*.jsonl")):
                new += self._read_new(path, offsets, self._insert_spans)
            metrics = self.run_dir / "metrics.jsonl"
            if metrics.is_file():
                self._read_new(metrics, offsets, self._insert_metrics)
        return new

    def ingest(self, records: Iterable[dict[str, Any]]) -> int:
        """Add span records received some other way (e.g. streamed to the driver)."""
        with self.conn:
            return self._insert_spans(records)

    def close(self) -> None:
        self.conn.close()

    def _read_new(self, path: Path, offsets: dict[str, int], insert) -> int:
        """Insert what `path` gained past its recorded offset (in the caller's transaction)."""
        key = str(path.relative_to(self.run_dir))
        offset = offsets.get(key, 0)
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is left for the next poll
        if end == 0:
            return 0
        records = []
        for line in data[:end].splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn line from a killed rank: skip it, keep the rest
        count = insert(records)
        self.conn.execute("INSERT OR REPLACE INTO ingested(file, offset) VALUES (?, ?)", (key, offset + end))
        return count

    def _insert_spans(self, records: Iterable[dict[str, Any]]) -> int:
        rows = [span_row(r) for r in records]
        self.conn.executemany("INSERT INTO spans VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
        return len(rows)

    def _insert_metrics(self, records: Iterable[dict[str, Any]]) -> int:
        rows = [(r["step"], *(r.get(k) for k in _METRIC_KEYS), json.dumps(r)) for r in records if "step" in r]
        self.conn.executemany("INSERT OR REPLACE INTO metrics VALUES (?,?,?,?,?,?)", rows)
        return len(rows)


def query(conn: sqlite3.Connection, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
    return [dict(row) for row in conn.execute(sql, params)]
