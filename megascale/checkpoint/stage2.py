"""The stage-2 writer as the rank sees it: a child process fed jobs, or the same work inline.

`CheckpointManager` decides what to save and when; this owns the process that writes it
(`checkpoint.writer`): starting it, handing it jobs, reading its results back, noticing that it
died, and ending it. Results are `(kind, step, info)` tuples, kind "ok" or "error", whichever
way the job ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import queue
import subprocess
import sys
import threading
from typing import Any

from megascale.checkpoint.writer import WriteJob, persist

log = logging.getLogger("megascale.checkpoint")
Result = tuple[str, int, Any]


class Stage2:
    def __init__(self, in_background: bool, rank: int):
        """`in_background` false (`checkpoint.async_save=false`): jobs run inline in `run_inline`."""
        self.in_background, self.rank = in_background, rank
        self._process: subprocess.Popen | None = None
        self._results: queue.Queue[Result] = queue.Queue()
        if in_background:
            self.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """A plain child process (not multiprocessing: it works under daemonic launchers and
        never re-imports the trainer's main module); results come back on its stdout."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "megascale.checkpoint.writer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # a launcher's SIGTERM to the rank's group must not kill a commit
        )
        self._collector = threading.Thread(
            target=self._collect, args=(self._process,), daemon=True, name=f"megascale-checkpoint-results-{self.rank}"
        )
        self._collector.start()

    def exit_code(self) -> int | None:
        """The background writer's exit code once it has died; None while it runs (or inline)."""
        return self._process.poll() if self._process is not None else None

    def submit(self, job: WriteJob) -> None:
        self._send({"job": dataclasses.asdict(job)})

    def abort(self, step: int) -> None:
        """Rank 0's committer would wait for a dead writer's part of `step` forever."""
        self._send({"abort": step})

    def report(self, result: Result) -> None:
        """A result that did not come from the writer (stage 1 failed before it got the job)."""
        self._results.put(result)

    @staticmethod
    def run_inline(job: WriteJob, buffer: memoryview) -> Result:
        try:
            return ("ok", job.step, persist(job, buffer))
        except Exception as exc:
            return ("error", job.step, f"{type(exc).__name__}: {exc}")

    def ready(self) -> list[Result]:
        """The results that have arrived, without waiting."""
        done = []
        while True:
            try:
                done.append(self._results.get_nowait())
            except queue.Empty:
                return done

    def next(self, timeout: float, inflight: int) -> Result | None:
        """The next result within `timeout` s; an error for `inflight` if the writer has died
        with nothing more to report; None if it is still writing."""
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            code = self.exit_code()
            if code is not None and self._results.empty():
                return ("error", inflight, f"the writer process died (exit code {code})")
            return None

    def detach(self) -> None:
        """Let the writer finish its current job and end, waiting for nothing."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._collector.join(timeout=5)

    def _collect(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            try:
                message = json.loads(line)
            except ValueError:  # something else printed: pass it on
                log.info("checkpoint writer: %s", line.rstrip())
                continue
            self._results.put((message["kind"], message["step"], message["info"]))

    def _send(self, message: dict) -> None:
        try:
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            log.error("cannot reach the checkpoint writer process: %s", exc)
