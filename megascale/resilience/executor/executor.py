"""The executor: one per node. Starts the node's ranks and reports on them every second.

It registers with the driver, then a heartbeat thread sends the node's report (address, host,
hardware, each rank's process status and last step, new log lines that match the error
keywords, interface traffic counters) and receives commands in the reply: `start` an attempt's
ranks (paused ranks named in `keep` rejoin), `pause` them (the fast path: failed ranks killed,
the others drop their process groups and wait), `stop` them, run the `selfcheck`, `exit`.
Commands run in their own thread so that the heartbeat never stops while a self-check or a stop
is in progress. If the driver is gone, the ranks keep training and the executor keeps knocking:
a restarted driver picks it up.

It trusts only a driver that holds the job's certificate (`api.py`), and even then runs only
commands its schemas accept (`protocol.py`). It registers with the join token and sends every
later request with the credential the driver gave its node (`identity.py`), kept in its work
directory so that a restarted executor is still that node. Ranks are warm standby processes
with a fixed command line (`ranks.py`) given their rank over their stdin: a config file and an environment
the schema bounds, never a command line the driver makes up. Its work directory and every file
in it are private (0700/0600, opened without following links); ranks get the executor's
environment minus secrets, plus the path of a 0600 file for the one secret they need.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from pydantic import ValidationError

from megascale.config.handoff import write_rank_files
from megascale.config.private_files import open_private, private_dir, read_secret, write_private
from megascale.resilience.common.api import ApiClient, ApiError, UntrustedDriver
from megascale.resilience.common.protocol import (
    COMMAND,
    COMMAND_ID,
    MAX_ERROR_LINES,
    CommandResult,
    HeartbeatReply,
    PauseCommand,
    RankReport,
    RegisterReply,
    SelfcheckCommand,
    StartCommand,
    first_error,
)
from megascale.resilience.common.rankstatus import STATUS_DIR_ENV, DeliveredSteps, read_status
from megascale.resilience.executor.ranks import RankProcess, StandbyPool, rank_environment, signal_group

log = logging.getLogger("megascale.executor")
KILL_GRACE_S = 1.0
CREDENTIAL = "credential"  # the node's own credential, in its work directory (0600)
UNTRUSTED_LOG_EVERY_S = 30.0
# A heartbeat the driver did not answer is retried at once and then after a growing pause, all
# well inside the driver's heartbeat timeout (5 s by default): one lost request, or a driver
# busy for a moment, must not cost the node its place. The request timeout is short for the
# same reason (`cli.py`).
REQUEST_TIMEOUT_S = 2.0
RETRY_S = (0.0, 0.25, 0.5, 1.0)
BUSY = (429, 503)  # the driver sheds load (api_budget.py, the handlers' queue): retried, never fatal


@dataclass
class Attempt:
    number: int
    status_dir: Path
    ranks: list[RankProcess] = field(default_factory=list)


class Executor:
    def __init__(
        self,
        client: ApiClient,
        node_id: str,
        address: str,
        workdir: Path,
        heartbeat_s: float = 1.0,
        shared_network: bool = False,
    ) -> None:
        self.client, self.node_id, self.address = client, node_id, address
        self.join_token = client.token
        self.workdir = private_dir(workdir)
        self.heartbeat_s = heartbeat_s
        self.shared_network = shared_network
        self.host = os.environ.get("POD_NAME") or socket.gethostname()
        self.keywords: list[str] = []
        self.attempt: Attempt | None = None
        self.done: dict[str, Any] = {}  # finished command id -> result, until acknowledged
        self.delivered = DeliveredSteps()  # each step's times are sent until a heartbeat is answered
        self.busy: str | None = None
        self.exit_requested = threading.Event()
        self._report_now = threading.Event()  # a command finished: its result goes out at once
        self._lock = threading.Lock()
        self._seq = 0
        self._gpus = _gpu_inventory()
        self._commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self._seen: set[str] = set()
        self._untrusted_logged = -UNTRUSTED_LOG_EVERY_S
        self.standbys = StandbyPool(self.workdir)
        threading.Thread(target=self._command_loop, name="executor-commands", daemon=True).start()

    # ------------------------------------------------------------------ registration, heartbeats
    def register(self, timeout_s: float = 120.0) -> None:
        """Register with the node's own credential when an earlier run of this executor kept one
        (the driver refuses a registered node's id to anyone else), else with the join token;
        the credential in the reply signs every later request."""
        deadline = time.monotonic() + timeout_s
        kept = self.workdir / CREDENTIAL
        if kept.exists():
            self.client.token = read_secret(kept, "the node's credential").decode().strip()
        while True:
            try:
                reply = self.client.call(
                    "POST",
                    "/v1/register",
                    {"node_id": self.node_id, "address": self.address, "host": self.host, "pid": os.getpid()},
                )
                reply = RegisterReply.model_validate(reply)
                break
            except ApiError as exc:
                if exc.status in BUSY and time.monotonic() < deadline:  # the driver sheds load
                    time.sleep(0.5)
                    continue
                if exc.status != 401 or self.client.token == self.join_token:
                    raise
                log.warning("the kept credential is not this job's (%s); registering with the join token", exc)
                kept.unlink(missing_ok=True)
                self.client.token = self.join_token
            except (OSError, ValidationError) as exc:
                if isinstance(exc, UntrustedDriver):
                    self._untrusted(exc)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"driver {self.client.url} unreachable: {exc}") from exc
                time.sleep(0.5)
        if reply.credential:
            self.client.token = reply.credential
            write_private(kept, reply.credential)
        self.keywords = reply.keywords
        self.heartbeat_s = reply.heartbeat_s
        self.standbys.wanted = reply.standby
        log.info("%s registered with %s as %s", self.node_id, self.client.url, reply.role)

    def run(self) -> int:
        """Heartbeat until told to exit; returns the process exit code."""
        psutil.cpu_percent(None)
        failures = 0
        while not self.exit_requested.is_set():
            started, unanswered = time.monotonic(), False
            try:
                reply = HeartbeatReply.model_validate(self.client.call("POST", "/v1/heartbeat", self.report()))
                self.delivered.answered()
                self._acknowledge(reply.ack)
                if reply.standby is not None:
                    self.standbys.wanted = reply.standby
                if reply.heartbeat_s is not None:
                    self.heartbeat_s = reply.heartbeat_s
                for command in reply.commands:
                    self._dispatch(command)
            except UntrustedDriver as exc:
                self._untrusted(exc)
            except ValidationError as exc:
                log.error("driver reply refused: %s", first_error(exc))
            except ApiError as exc:
                if exc.status == 403:  # evicted and blocked: this node must not come back
                    log.error("%s: driver refused us (%s); exiting", self.node_id, exc)
                    self.stop_ranks()
                    return 3
                log.warning("heartbeat rejected: %s", exc)
                unanswered = exc.status in BUSY  # the driver sheds load: soon again, not in a period
            except OSError as exc:
                log.warning("driver unreachable (%s); ranks keep running", exc)
                unanswered = True
            failures = failures + 1 if unanswered else 0
            if unanswered:
                pause = min(RETRY_S[min(failures, len(RETRY_S)) - 1], self.heartbeat_s)
            else:
                pause = max(0.0, self.heartbeat_s - (time.monotonic() - started))
            self._report_now.wait(pause)
            self._report_now.clear()
        self.stop_ranks()
        return 0  # the standbys end with this process (PR_SET_PDEATHSIG)

    def _untrusted(self, exc: UntrustedDriver) -> None:
        """Refused and logged (every 30 s while it lasts); the real driver may come back."""
        if time.monotonic() - self._untrusted_logged >= UNTRUSTED_LOG_EVERY_S:
            log.error("%s; no command is taken from it", exc)
            self._untrusted_logged = time.monotonic()

    def report(self) -> dict[str, Any]:
        self._seq += 1
        mem = psutil.virtual_memory()
        with self._lock:
            attempt = self.attempt
            ranks, errors = ([], []) if attempt is None else self._rank_reports(attempt)
            done, busy = dict(self.done), self.busy
        return {
            "node_id": self.node_id,
            "seq": self._seq,
            "time": time.time(),
            "address": self.address,
            "host": self.host,
            "hardware": {
                "cpus": psutil.cpu_count(),
                "cpu_percent": psutil.cpu_percent(None),
                "mem_total": mem.total,
                "mem_used": mem.used,
                "gpus": self._gpus,
            },
            "attempt": attempt.number if attempt else None,
            "ranks": ranks,
            "errors": errors,
            "net": {
                n[:64]: [c.bytes_sent, c.bytes_recv] for n, c in list(psutil.net_io_counters(pernic=True).items())[:512]
            },
            "net_shared": self.shared_network,
            "done": done,
            "busy": busy,
        }

    def _rank_reports(self, attempt: Attempt) -> tuple[list[dict], list[dict]]:
        ranks, errors = [], []
        self.delivered.begin(attempt.number)
        for rp in attempt.ranks:
            ended = rp.exited_at is not None  # an exit is reported with its time or not yet
            process = {
                "rank": rp.rank,
                "local_rank": rp.local_rank,
                "pid": rp.proc.pid,
                "alive": not ended,
                "exitcode": rp.proc.returncode if ended else None,
                "exited_at": rp.exited_at,
                "state": None if ended else _process_state(rp.proc.pid),
            }
            status = read_status(attempt.status_dir, rp.rank) or {}
            report = {
                **process,
                "step": status.get("step"),
                "step_time": status.get("step_time"),
                "recent": self.delivered.new(rp.rank, "recent", status.get("recent", [])),
                "compute": self.delivered.new(rp.rank, "compute", status.get("compute", [])),
                "status_time": status.get("time"),
                "start": status.get("start"),
                "phase": status.get("phase"),
            }
            try:  # what the driver will accept; a garbled status file costs the progress, not the node
                RankReport.model_validate_json(json.dumps(report))
            except (ValidationError, TypeError, ValueError):
                report = process
            ranks.append(report)
            errors += [{"rank": rp.rank, "text": line[:4000]} for line in self._new_error_lines(rp)]
        return ranks, errors[:MAX_ERROR_LINES]

    def _new_error_lines(self, rp: RankProcess) -> list[str]:
        try:
            with open(rp.log_path, "rb") as f:
                f.seek(rp.offset)
                data = f.read(1 << 20)
        except OSError:
            return []
        rp.offset += len(data)
        data = rp.partial + data
        cut = data.rfind(b"\n") + 1
        rp.partial = data[cut:]
        lines = data[:cut].decode(errors="replace").splitlines()
        return [line for line in lines if any(k in line for k in self.keywords)]

    def _acknowledge(self, ids: list[str]) -> None:
        with self._lock:
            for command_id in ids:
                self.done.pop(command_id, None)

    # ------------------------------------------------------------------ commands
    def _dispatch(self, command: dict[str, Any]) -> None:
        command_id = str(command.get("id"))
        with self._lock:
            if command_id in self._seen:
                return  # queued or done; the driver has not seen the result yet
            self._seen.add(command_id)
        try:
            self._commands.put(COMMAND.validate_python(command))
        except ValidationError as exc:
            log.error("refused a malformed %r command from the driver: %s", command.get("kind"), first_error(exc))
            if re.fullmatch(COMMAND_ID, command_id):
                with self._lock:
                    self.done[command_id] = {"ok": False, "error": f"refused by the executor: {first_error(exc)}"}

    def _command_loop(self) -> None:
        """One long-lived thread runs the commands in order and keeps the standbys topped up: the
        processes it starts are tied to it (PR_SET_PDEATHSIG fires when the forking *thread*
        ends), and heartbeats go on meanwhile."""
        handlers = {
            "start": self._start,
            "pause": self._pause,
            "stop": self._stop,
            "selfcheck": self._selfcheck,
            "exit": self._exit,
        }
        while True:
            try:
                command = self._commands.get(timeout=0.5)
            except queue.Empty:
                self._top_up()
                continue
            self._run_command(handlers[command.kind], command)

    def _top_up(self) -> None:
        if self.exit_requested.is_set():
            return
        try:
            self.standbys.top_up()
        except OSError as exc:  # a full process table, a work directory gone: try again later
            log.error("cannot start a standby rank process: %s", exc)

    def _run_command(self, handler, command) -> None:
        with self._lock:
            self.busy = command.id
        try:
            result = handler(command)
        except Exception as exc:  # report it: the driver decides what a failed command means
            log.exception("command %s failed", command.kind)
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}
        try:  # a result the driver would refuse (say, a NaN figure) would cost every later heartbeat
            CommandResult.model_validate_json(json.dumps(result))
        except (ValidationError, ValueError) as exc:
            detail = first_error(exc) if isinstance(exc, ValidationError) else str(exc)
            result = {"ok": False, "error": f"{command.kind} result not reportable: {detail}"}
        with self._lock:
            self.done[command.id] = result
            self.busy = None
        self._report_now.set()  # a recovery waits on this result: no need to wait for the next beat

    def _start(self, command: StartCommand) -> dict[str, Any]:
        """Attempt N's ranks: paused ranks named in `keep` rejoin, the others are standbys given
        their rank (a new process when no standby is ready)."""
        with self._lock:
            previous = self.attempt
        kept = {
            rp.rank: rp
            for rp in (previous.ranks if previous else [])
            if rp.rank in command.keep and rp.exited_at is None
        }
        self.stop_ranks(spare=set(kept))
        base = private_dir(self.workdir / f"attempt{command.attempt}")
        attempt = Attempt(command.attempt, private_dir(base / "status"))
        config, secret_env = write_rank_files(base / "rank", command.config, command.redis_password)
        try:
            logs = {}  # every log made (never through a planted link) before any rank is assigned
            for rank in command.ranks:
                if rank not in kept:
                    logs[rank] = base / f"rank{rank:05d}.log"
                    os.close(open_private(logs[rank]))
            for local, rank in enumerate(command.ranks):
                env = self.rank_env(command, local, attempt.status_dir, secret_env)
                if rank in kept:
                    rp = kept[rank]
                    rp.local_rank = local
                    rp.send({"kind": "rejoin", "config": str(config), "env": env})
                else:
                    rp = RankProcess(rank, local, self.standbys.take(), logs[rank])
                    rp.watch_exit()
                    rp.send({"kind": "assign", "config": str(config), "env": env, "log": str(logs[rank])})
                attempt.ranks.append(rp)
        finally:
            with self._lock:
                self.attempt = attempt  # the ranks started so far are stopped with the attempt
        return {"ok": True, "pids": [rp.proc.pid for rp in attempt.ranks]}

    @staticmethod
    def rank_env(command: StartCommand, local: int, status_dir: Path, secret_env: dict[str, str]) -> dict[str, str]:
        """What a rank adds to the environment it was started with (the executor's, less secrets):
        the attempt's variables, the planner's where the node sets none, its place, its files."""
        own = rank_environment()
        return {
            **{k: v for k, v in command.plan_env.items() if k not in own},
            **command.env,
            **secret_env,
            "RANK": str(command.ranks[local]),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(len(command.ranks)),
            STATUS_DIR_ENV: str(status_dir),
        }

    def _pause(self, command: PauseCommand) -> dict[str, Any]:
        """The fast path's stop: kill the failed ranks, tell the others to drop their process
        groups, and wait until each says it is paused (or is gone; one that is neither by the
        deadline is killed: the driver then replaces it too)."""
        with self._lock:
            attempt = self.attempt
        if attempt is None or attempt.number != command.attempt:
            return {"ok": True, "paused": [], "dead": []}
        for rp in attempt.ranks:
            if rp.rank in command.kill:
                signal_group(rp.proc.pid, signal.SIGKILL)
            else:
                rp.send({"kind": "abort"})
        deadline = time.monotonic() + command.timeout_s
        waiting = [rp for rp in attempt.ranks if rp.rank not in command.kill]
        while waiting and time.monotonic() < deadline:
            waiting = [
                rp
                for rp in waiting
                if rp.proc.poll() is None and (read_status(attempt.status_dir, rp.rank) or {}).get("phase") != "paused"
            ]
            time.sleep(0.02)
        for rp in waiting:
            log.error("rank %d did not pause within %.0f s: killing it", rp.rank, command.timeout_s)
            signal_group(rp.proc.pid, signal.SIGKILL)
        for rp in attempt.ranks:
            if rp.rank in command.kill or rp in waiting:
                rp.proc.wait()
        paused = [rp.rank for rp in attempt.ranks if rp.proc.poll() is None]
        return {"ok": True, "paused": paused, "dead": [rp.rank for rp in attempt.ranks if rp.rank not in paused]}

    def _stop(self, command) -> dict[str, Any]:
        return {"ok": True, "stopped": self.stop_ranks()}

    def _exit(self, command) -> dict[str, Any]:
        self.stop_ranks()
        self.exit_requested.set()
        self._report_now.set()
        return {"ok": True}

    def _selfcheck(self, command: SelfcheckCommand) -> dict[str, Any]:
        self.stop_ranks()
        argv = [
            sys.executable,
            "-m",
            "megascale.cli",
            "selfcheck",
            "--json",
            "--node-id",
            self.node_id,
            "--address",
            self.address,
            "--plan",
            command.plan.model_dump_json(),
        ]
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=command.timeout_s,
            env={**rank_environment(), "OMP_NUM_THREADS": "1"},
        )
        try:
            return {"ok": True, "report": json.loads(out.stdout.strip().splitlines()[-1])}
        except (ValueError, IndexError):
            return {"ok": False, "error": f"selfcheck exit {out.returncode}: {out.stderr[-2000:]}"}

    def stop_ranks(self, spare: set[int] = frozenset()) -> int:
        """SIGTERM, then SIGKILL the ranks' process groups (a SIGSTOPped rank only dies by KILL);
        ranks in `spare` are left alone (they rejoin the next attempt)."""
        with self._lock:
            attempt = self.attempt
        if attempt is None:
            return 0
        ranks = [rp for rp in attempt.ranks if rp.rank not in spare]
        live = [rp for rp in ranks if rp.proc.poll() is None]
        for rp in live:
            signal_group(rp.proc.pid, signal.SIGTERM)
            signal_group(rp.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + KILL_GRACE_S
        for rp in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rp.proc.wait(max(0.0, deadline - time.monotonic()))
        for rp in ranks:
            signal_group(rp.proc.pid, signal.SIGKILL)  # also the group's leftovers (checkpoint
            # writers are in sessions of their own: they finish a commit, then end with their input)
            rp.proc.wait()
        return len(live)


def _process_state(pid: int) -> str | None:
    """`running`, `sleeping`, `stopped` (SIGSTOP), `disk-sleep`, `zombie`...: a hang's culprit shows here."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def _gpu_inventory() -> list[dict[str, Any]]:
    """GPUs via torch.cuda, imported only where a GPU driver is present (torch costs seconds)."""
    if not (shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists()):
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    return [
        {"index": i, "name": torch.cuda.get_device_name(i), "memory": torch.cuda.get_device_properties(i).total_memory}
        for i in range(torch.cuda.device_count())
    ]
