"""A rank under an executor: a warm standby until assigned, then a trainer that outlives faults.

`megascale train --standby-server` imports everything a rank needs (torch, the model, the
trainer) and warms up once, then forks a standby per request of its executor
(`resilience/rank/forks.py`). A standby waits on its stdin for the executor's assignment
(`resilience/rank/rankctl.py`), so process start and imports are off the recovery's critical
path, and a new standby costs a fork. Once assigned it trains; when a peer fails (a
collective's connection closes, or the executor says `abort`), it does not die: it drops its
process groups without waiting for anything in flight, keeps the peer copies it holds
(`checkpoint/replica.py`), says "paused" in its status file and waits for `rejoin`, which names
the next attempt's rendezvous. It then builds a new trainer in the same process and restores its
state from memory (its own copy, or a peer's over the network), or from storage when no complete
set of copies exists. An error of its own (an exception that is not a peer's failure) ends the
process as before: its executor replaces it.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import socket
import sys

import torch

from megascale.checkpoint.replica import ReplicaStore
from megascale.config import ConfigError, load_config
from megascale.config.private_files import open_private
from megascale.data import corpus
from megascale.data.shards import DataError
from megascale.diagnostics.mfu import peak_flops
from megascale.layout.launch import LaunchEnv
from megascale.plan.env import format_applied
from megascale.resilience.common.protocol import Assign, Rejoin
from megascale.resilience.common.rankstatus import StatusWriter
from megascale.resilience.rank.faults import StepHook, rank_step_hook
from megascale.resilience.rank.forks import serve_forks
from megascale.resilience.rank.rankctl import RankControl, is_peer_failure
from megascale.train.trainer import Trainer

log = logging.getLogger("megascale")
PAUSED = None  # what `generation` returns when the rank waits for the next attempt
COMMUNICATION_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_")


def serve_standbys() -> int:
    """The node's standby server: warm up, then fork standbys until the executor is gone."""
    warm_up()
    return serve_forks(socket.socket(fileno=0), serve)


def serve() -> int:
    """A standby: wait for an assignment, then train through every in-place recovery; the exit code."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():  # the server's torch read the server's environment
        torch.set_num_threads(int(threads))
    control = RankControl()
    assignment = control.next()
    if assignment is None:  # dismissed before it was needed
        return 0
    if not isinstance(assignment, Assign):
        print("megascale train: a standby's first message from the executor must be an assignment", file=sys.stderr)
        return 2
    _output_to(assignment.log)
    replicas = ReplicaStore()
    message: Assign | Rejoin = assignment
    while True:
        os.environ.update(message.env)  # not in /proc/PID/environ: the log line below says it
        code = generation(message.config, replicas, control)
        if code is not PAUSED:
            return code
        message = control.next()
        if message is None:
            return 1  # the executor is gone: nothing will ever ask this rank back
        log.info(
            "rejoining as rank %s of attempt %s", message.env.get("RANK"), message.env.get("MEGASCALE_RESTART_ATTEMPT")
        )


def warm_up() -> None:
    """Pay once, in the server, what every standby's first trainer would: the imports torch does
    lazily (torch.optim's first parameter group brings in torch._dynamo), the CPU's peak FLOP/s
    probe and the default corpus's identity (both kept for the process, and so for its forks).
    Nothing here may initialise CUDA (`torch.cuda.is_available` would): the forks could not use it."""
    importlib.import_module("torch._dynamo")
    if not torch.backends.cuda.is_built():
        peak_flops(torch.device("cpu"), "fp32")
    corpus.source()


def generation(config: str, replicas: ReplicaStore, control: RankControl) -> int | None:
    """One attempt of this rank: train to the end (an exit code) or until a peer fails (PAUSED)."""
    try:
        cfg = load_config(config, [])
    except ConfigError as exc:
        print(f"megascale train: config error: {exc}", file=sys.stderr)
        return 2
    trainer, failure = None, None
    try:
        trainer = Trainer(cfg, replicas)
        log.info("%s", format_applied({k: v for k, v in os.environ.items() if k.startswith(COMMUNICATION_PREFIXES)}))
        hook = rank_step_hook(trainer.rank, facts=trainer)
        if hook is not None:
            trainer.step_hooks.append(hook)
        trainer.fit()
    except Exception as exc:
        if not is_peer_failure(exc, control.aborted.is_set()):
            if isinstance(exc, ConfigError | DataError):  # its message, not a traceback
                print(f"megascale train: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 2
            raise
        failure = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    if failure is not None:  # outside the handler: the traceback no longer holds the trainer's frames
        log.warning("a peer failed (%s): dropping the process groups, waiting for the next attempt", failure)
        status = next((h.status for h in trainer.step_hooks if isinstance(h, StepHook)), None) if trainer else None
        if trainer is not None:
            trainer.abandon()
        trainer = None
        gc.collect()  # the groups' sockets close with their last reference
        (status or StatusWriter(LaunchEnv.from_env().rank)).paused()
        return PAUSED
    trainer.close()
    if not trainer.final_save.saved:
        print(f"megascale train: {trainer.final_save.describe()}", file=sys.stderr)
        return 1
    return 0


def _output_to(path: str) -> None:
    """From now on stdout and stderr go to the rank's log (opened as every rank log is)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = open_private(path)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
