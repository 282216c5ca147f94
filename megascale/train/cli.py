"""`megascale train`: one process, under torchrun, or `--nproc N` local ranks (`--standby-server`:
the ranks under an executor, train/worker.py).

`--nproc N` re-launches this command under PyTorch's elastic launcher (`torch.distributed.run`,
what `torchrun` is) with N processes on this machine, so a local multi-rank run and a cluster
run under torchrun execute the same code. The ranks read the config this process resolved,
from a private file (config/handoff.py), not the overrides again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from megascale.config import ConfigError, JobConfig, default_config_path, load_config
from megascale.config.handoff import config_text, with_generated_password, write_rank_files
from megascale.config.operations import checkpoint_root
from megascale.config.schema import REDIS_PASSWORD_ENV, CheckpointConfig, ModelConfig, redacted_url
from megascale.layout.grid import RankGrid
from megascale.layout.launch import LaunchEnv
from megascale.plan.env import format_applied, launch_env, with_defaults
from megascale.plan.memory import check_memory_limit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="TOML config over the built-in defaults (default: the packaged "
        "megascale/config/default.toml, a small model on CPU)",
    )
    parser.add_argument(
        "--nproc", type=int, default=0, help="start N local ranks (default: dp*tp*pp of the config when > 1)"
    )
    parser.add_argument(
        "--standby-server",
        action="store_true",
        help="(executors) a node's warm standby ranks: import everything once, then fork a rank "
        "per request on the Unix socket that is stdin; each takes its assignment, config and "
        "environment from its own stdin and stays alive through in-place recoveries",
    )
    parser.epilog = "Override any config key with --section.key=value, e.g. --model.layers=8"


def run(args: argparse.Namespace) -> int:
    if args.standby_server:
        from megascale.train.worker import serve_standbys

        return serve_standbys()
    path = args.config or default_config_path()
    under_launcher = LaunchEnv.from_env().launched
    if not under_launcher:  # ranks started by a launcher read the file it resolved: it said this
        print(
            f"megascale train: config {path}{'' if args.config else ' (packaged default)'} "
            f"with {len(args.overrides)} override(s); the log lists what differs from the built-in defaults",
            file=sys.stderr,
        )
    try:
        cfg = load_config(path, args.overrides)
        check_memory_limit(cfg, cfg.train.device)  # once here, not once per rank it would start
    except ConfigError as exc:
        print(f"megascale train: config error: {exc}", file=sys.stderr)
        return 2
    if cfg.checkpoint.init_from and not _init_from_fits(cfg.checkpoint.init_from, cfg.model):
        return 2
    world = RankGrid.of(cfg.parallel).world_size
    nproc = args.nproc or (world if world > 1 and not under_launcher else 0)
    if nproc and not under_launcher:
        if nproc != world:
            print(f"megascale train: --nproc {nproc} but parallel.dp*tp*pp = {world}; make them equal", file=sys.stderr)
            return 2
        return launch_local(nproc, cfg)
    from megascale.data.shards import DataError
    from megascale.resilience.rank.faults import rank_step_hook
    from megascale.train.trainer import Trainer

    try:  # a bad value or dataset found while building: its message, not a traceback
        trainer = Trainer(cfg)
    except (ConfigError, DataError) as exc:
        print(f"megascale train: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    hook = rank_step_hook(trainer.rank, facts=trainer)  # only under an executor, or when a test injects faults
    if hook is not None:
        trainer.step_hooks.append(hook)
    try:
        trainer.fit()
    except KeyboardInterrupt:  # a second Ctrl-C: out at once, nothing saved
        return 130
    finally:
        trainer.close()
    if not trainer.final_save.saved:  # a run whose last step is not on storage did not succeed
        print(f"megascale train: {trainer.final_save.describe()}", file=sys.stderr)
        return 1
    return 128 + trainer.stop_signal if trainer.stop_signal else 0  # as if killed by it, once saved


def _init_from_fits(init_from: str, model: ModelConfig) -> bool:
    """The pretrained checkpoint exists, is supported and matches the model config: said here,
    in one line, before any rank starts."""
    from megascale.interop.hf_files import InteropError
    from megascale.interop.pretrained import init_source

    try:
        init_source(init_from, model)
    except InteropError as exc:
        print(f"megascale train: {exc}", file=sys.stderr)
        return False
    return True


def launch_local(nproc: int, cfg: JobConfig) -> int:
    """Run the ranks under torch.distributed.run; with `parallel.redis_start`, host their Redis too."""
    from megascale.resilience.common.redis_server import RedisServer

    with ExitStack() as job:
        private = job.enter_context(tempfile.TemporaryDirectory(prefix="megascale-train-"))
        if cfg.parallel.redis_start and not cfg.parallel.redis_password():  # the job's own Redis never runs
            cfg.parallel.redis_url = with_generated_password(cfg.parallel.redis_url)  # without one
        config, secret_env = write_rank_files(private, config_text(cfg), cfg.parallel.redis_password())
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "megascale.cli",
            "train",
            "--config",
            str(config),
        ]
        planned = launch_env(cfg.train.run_dir, cfg.diagnostics.flight_recorder)
        env = with_defaults({k: v for k, v in os.environ.items() if k != REDIS_PASSWORD_ENV}, planned) | secret_env
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        print(
            f"megascale train: {nproc} local ranks on this node; {format_applied(planned)} "
            "(values already in the environment win)",
            file=sys.stderr,
        )
        if cfg.parallel.redis_start:
            try:
                redis_server = job.enter_context(RedisServer.for_job(cfg.parallel))
            except (FileNotFoundError, RuntimeError) as exc:  # no redis-server, or it did not start
                print(f"megascale train: {exc}", file=sys.stderr)
                return 2
            print(f"megascale train: redis-server for this job at {redacted_url(redis_server.url)}", file=sys.stderr)
        saved = partial(what_was_saved, cfg.checkpoint, cfg.train.run_dir)
        return _wait_forwarding_sigterm(subprocess.Popen(cmd, env=env), saved)


def _wait_forwarding_sigterm(proc: subprocess.Popen, saved: Callable[[], str]) -> int:
    """Wait for the ranks' launcher. A SIGTERM sent to this process alone (Kubernetes signals only
    a container's first process) is passed on once, so the ranks stop and save; Ctrl-C already
    reaches every process of the terminal's group, so here it is only kept from ending the wait.
    `saved` says what was saved, once the ranks have stopped."""
    forwarded = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal forwarded
        if signum == signal.SIGTERM and not forwarded:
            forwarded = True
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if forwarded and code:  # torchrun reports the ranks' exit 143 as a failure above this line
        print(f"megascale train: stopped by SIGTERM; {saved()}", file=sys.stderr)
    return code


def what_was_saved(checkpoint: CheckpointConfig, run_dir: str) -> str:
    """The step the ranks reached and the newest valid checkpoint, both read from the run's files
    (metrics.jsonl, the checkpoint root), so that the message cannot claim a save that failed."""
    from megascale.checkpoint.catalog import candidates
    from megascale.checkpoint.storage import open_root

    reached = None
    metrics = Path(run_dir) / "metrics.jsonl"
    with contextlib.suppress(OSError, ValueError, IndexError, KeyError):
        reached = json.loads(metrics.read_text().splitlines()[-1])["step"]
    fs, root = open_root(checkpoint_root(checkpoint, run_dir))
    found = candidates(fs, root)
    if not found:
        return "nothing is saved; the same command starts from scratch"
    path, manifest = found[0]
    if manifest["step"] == reached:
        return f"step {reached} is saved in {path}; the same command resumes from it"
    lost = f"step {reached} was NOT saved (see the ranks' logs); " if reached is not None else ""
    return f"{lost}the newest valid checkpoint is step {manifest['step']} ({path}); the same command resumes from it"
