"""The driver's job state, persisted in SQLite so that a restarted driver carries on.

What must survive a driver crash is small and changes rarely: which nodes are active, spare or
evicted, the blocked addresses, the attempt and restart counts, the layout, and the record of
faults and alerts (for ETTR). Heartbeats are volatile and are not stored. The job's fields are
one JSON row and each node one row of its own: a registration writes its node's row only (O(1),
not the whole job), the rarer changes of phase rewrite the lot, each in a transaction; events
are appended to a log. Every write carries a sequence number taken where the change was made,
and a row is only ever replaced by a newer one, so writes done outside the driver's lock cannot
bring back an older state. WAL with `synchronous=NORMAL`: a commit survives the driver's crash
(what a restarted driver needs) without a disk sync each; a power cut of the driver's host may
lose the last commits (executors then register again, see `driver.py`).
The database (and its -wal and -shm files, which SQLite makes with the database's mode) is 0600,
and nothing secret goes into it: the job's config is kept without the Redis password.
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Node roles. SUSPECT: taken out by a fast recovery, its self-check running beside the job.
ACTIVE, SPARE, EVICTED, SUSPECT = "active", "spare", "evicted", "suspect"
# Job phases. RUNNING: ranks train; on a fault, RECOVERING (the fast path: survivors paused) or
# STOPPING -> CHECKING (the restart path), then RUNNING again.
STARTING, RUNNING, STOPPING, CHECKING = "starting", "running", "stopping", "checking"
RECOVERING = "recovering"
COMPLETE, FAILED, CANCELLED = "complete", "failed", "cancelled"
FINISHED = (COMPLETE, FAILED, CANCELLED)

SCHEMA = """
CREATE TABLE IF NOT EXISTS job (id INTEGER PRIMARY KEY CHECK (id = 0), state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL, kind TEXT, data TEXT
);
CREATE INDEX IF NOT EXISTS events_kind ON events (kind, id);
"""
UPSERT_NODE = (
    "INSERT INTO nodes (id, seq, data) VALUES (?, ?, ?) ON CONFLICT (id) DO UPDATE "
    "SET seq = excluded.seq, data = excluded.data WHERE excluded.seq > nodes.seq"
)


@dataclass
class Node:
    node_id: str
    address: str
    host: str
    role: str = SPARE
    slot: int = -1  # position among the active nodes (its ranks: slot*rpn ...)
    faults: int = 0  # faults blamed on this node over the whole job
    pid: int | None = None  # local mode: the executor's process id
    registered: float = 0.0


@dataclass
class JobState:
    job_id: str
    nodes_wanted: int
    ranks_per_node: int
    layout: dict[str, int]  # dp, tp, pp of the current attempt
    train_config: str = ""  # the ranks' TOML (config/handoff.py), fixed at the job's first launch
    run_dir: str = ""
    phase: str = STARTING
    attempt: int = 0
    restarts: int = 0
    restart_budget: int = 10
    nodes: dict[str, Node] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)  # addresses never readmitted
    master: dict[str, Any] = field(default_factory=dict)  # addr/port of the current attempt
    api: dict[str, Any] = field(default_factory=dict)  # host/port the driver serves on
    created: float = field(default_factory=time.time)
    attempt_started: float = 0.0
    finished: float | None = None
    reason: str = ""

    def role(self, role: str) -> list[Node]:
        return sorted(
            (n for n in self.nodes.values() if n.role == role), key=lambda n: (n.slot, n.registered, n.node_id)
        )

    @property
    def evicted(self) -> list[str]:
        return [n.node_id for n in self.role(EVICTED)]

    def to_json(self, nodes: bool = True) -> str:
        data = asdict(self)
        if not nodes:
            del data["nodes"]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str, nodes: dict[str, Node] | None = None) -> JobState:
        data = json.loads(text)
        data["nodes"] = {k: Node(**v) for k, v in data.get("nodes", {}).items()}  # an older store's
        data["nodes"].update(nodes or {})
        return cls(**data)


class JobStore:
    """One SQLite file; safe to use from the API threads and the control loop."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        for path in (self.path, *(self.path.with_name(self.path.name + s) for s in ("-wal", "-shm"))):
            if path.exists():
                path.chmod(0o600)  # made by an older version, or with a looser umask
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(SCHEMA)
        self._seq = itertools.count(1 + (self._conn.execute("SELECT MAX(seq) FROM nodes").fetchone()[0] or 0))

    def load(self) -> JobState | None:
        with self._lock:
            row = self._conn.execute("SELECT state FROM job WHERE id = 0").fetchone()
            nodes = self._conn.execute("SELECT id, data FROM nodes").fetchall()
        return JobState.from_json(row[0], {k: Node(**json.loads(v)) for k, v in nodes}) if row else None

    def sequence(self) -> int:
        """A number for a change made now: call it where the change is made (under the driver's lock)."""
        return next(self._seq)

    def save(self, state: JobState) -> None:
        """The whole state (phase changes, evictions: rare); O(nodes)."""
        seq = self.sequence()
        rows = [(n.node_id, seq, json.dumps(asdict(n))) for n in state.nodes.values()]
        with self._lock, self._conn:
            self._conn.execute("INSERT OR REPLACE INTO job (id, state) VALUES (0, ?)", (state.to_json(nodes=False),))
            self._conn.executemany(UPSERT_NODE, rows)

    def save_node(self, node_json: str, node_id: str, seq: int) -> None:
        """One node's row (a registration): O(1), and safe outside the driver's lock given the
        `seq` and the JSON taken under it."""
        with self._lock, self._conn:
            self._conn.execute(UPSERT_NODE, (node_id, seq, node_json))

    def event(self, kind: str, data: dict[str, Any], when: float | None = None) -> None:
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO events (time, kind, data) VALUES (?, ?, ?)",
                (when if when is not None else time.time(), kind, json.dumps(data, default=str)),
            )

    def events(self, kind: str | tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        """The log, or its events of one kind (or of several), oldest first."""
        sql, args = "SELECT id, time, kind, data FROM events", ()
        if kind is not None:
            kinds = (kind,) if isinstance(kind, str) else kind
            sql, args = sql + f" WHERE kind IN ({', '.join('?' * len(kinds))})", kinds
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY id", args).fetchall()
        return [{"id": i, "time": t, "event": k, **json.loads(d)} for i, t, k, d in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
