"""A local fault-tolerant job driven from a test: start, watch through the API, act, finish."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from megascale.resilience.common.api import ApiClient
from megascale.resilience.driver.ettr import final_records

REPO = Path(__file__).resolve().parents[2]
# 2 nodes x 2 ranks, dp=4, a tiny model: seconds of training; start-up dominates on 2 cores.
TRAIN = [
    "--parallel.dp=4",
    "--model.layers=2",
    "--model.hidden=64",
    "--model.heads=4",
    "--model.seq_len=64",
    "--train.global_batch=8",
    "--train.micro_batch=2",
    "--train.steps=16",
    "--checkpoint.every=4",
    "--checkpoint.peer_every=2",
    "--train.tensorboard=false",
    "--train.eval_every=0",
    "--diagnostics.flight_recorder=false",
]
RESILIENCE = [
    "--resilience.hang_floor_s=5",
    "--resilience.heartbeat_timeout_s=4",
    "--resilience.startup_timeout_s=120",
    "--resilience.restart_budget=3",
]
# Rank 0 pauses after step 2 (inside the warm-up, so no hang): a window for outside actions.
PAUSE = "sleep:rank=0:step=2:seconds=12"


class Job:
    def __init__(
        self, run_dir: Path, fault: str = "", spares: int = 1, netns: bool = False, extra: tuple[str, ...] = ()
    ) -> None:
        self.run_dir, self.fault = run_dir, fault
        self.args = [
            sys.executable,
            "-m",
            "megascale.cli",
            "launch",
            "--nodes",
            "2",
            "--ranks-per-node",
            "2",
            "--spares",
            str(spares),
            *(["--netns"] if netns else []),
            *TRAIN,
            *RESILIENCE,
            f"--train.run_dir={run_dir}",
            *extra,
        ]
        self.procs: list[subprocess.Popen] = []
        self._client: ApiClient | None = None

    def start(self) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASCALE_FAULT": self.fault}
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.run_dir.parent / f"launch{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self._client = None
        return proc

    @property
    def client(self) -> ApiClient:
        if self._client is None:
            self._client = ApiClient.for_run(self.run_dir)
        return self._client

    def status(self) -> dict | None:
        try:
            return self.client.status()
        except (OSError, ValueError):
            self._client = None
            return None

    def wait_for(self, predicate, timeout_s: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status()
            if status is not None and predicate(status):
                return status
            if self.procs[-1].poll() is not None:
                raise AssertionError(f"driver exited with {self.procs[-1].returncode}: {self.log_tail()}")
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting; last status {status}; {self.log_tail()}")

    def finish(self, timeout_s: float = 300.0) -> dict:
        try:
            code = self.procs[-1].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not finish in {timeout_s} s: {self.log_tail()}") from None
        summary = json.loads((self.run_dir / "resilience" / "summary.json").read_text())
        assert code == 0 and summary["phase"] == "complete", (code, summary, self.log_tail())
        return summary

    def losses(self, last: int = 4) -> dict[int, float]:
        records = final_records(self.run_dir / "metrics.jsonl")
        steps = sorted(records)[-last:]
        return {s: records[s]["loss"] for s in steps}

    def executor_pids(self) -> dict[str, int]:
        path = self.run_dir / "resilience" / "driver.sqlite"
        if not path.is_file():
            return {}
        with contextlib.closing(sqlite3.connect(path)) as conn:
            row = conn.execute("SELECT state FROM job").fetchone()
        return {} if row is None else json.loads(row[0])["api"].get("executor_pids", {})

    def log_tail(self, chars: int = 3000) -> str:
        logs = sorted(self.run_dir.parent.glob("launch*.log"))
        return logs[-1].read_text(errors="replace")[-chars:] if logs else ""

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in self.executor_pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def node_of_rank(status: dict, rank: int) -> str:
    per_node = 2
    slot = rank // per_node
    return next(n for n, info in status["nodes"].items() if info["role"] == "active" and info["slot"] == slot)


def max_step(status: dict) -> int:
    return max((r.get("step") or 0 for n in status["nodes"].values() for r in n["ranks"]), default=0)


def paused_after_step_2(status: dict) -> bool:
    """The job runs, rank 0 sleeps after step 2 (PAUSE; its status says step 2 only when it wakes)
    and every other rank has finished step 2, so step 2's peer copies are made. Any one rank at
    step 2 was not enough: on CI's loaded cores node 1 was killed before its rank had copied step
    2, and the spare restored from nothing instead of peer memory."""
    steps = {r["rank"]: r.get("step") or 0 for n in status["nodes"].values() for r in n["ranks"]}
    others = [step for rank, step in steps.items() if rank != 0]
    return status["phase"] == "running" and len(steps) == 4 and min(others) >= 2  # TRAIN's dp=4
