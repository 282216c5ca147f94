"""`megascale launch`: run a job under the fault-tolerant driver.

Local mode (`--nodes N --ranks-per-node R --spares S`) starts one executor per simulated node
on this machine (`--netns`: each in its own network namespace). Cluster mode (`--external`)
starts only the driver; the scheduler starts `megascale executor --driver URL` on each node.
Running the same command again with the same run directory continues an unfinished job: the
new driver reads the state its predecessor left and the executors carry on.

The driver makes its run directory private (0700; files 0600 through its umask, which local
executors and ranks inherit), its secret directory if it is missing (`credentials.py`) and
serves its API over TLS with it; `driver.json` says where (URL, secret directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megascale.config import ConfigError, JobConfig, ParallelConfig, load_config
from megascale.config.handoff import config_text, with_generated_password
from megascale.config.private_files import UnsafePathError, private_dir, write_private
from megascale.config.schema import redacted_url
from megascale.plan.memory import check_memory_limit
from megascale.resilience.common import protocol
from megascale.resilience.common.credentials import JobSecret, SecretError, ensure_secret, load_secret, server_context
from megascale.resilience.driver.api_budget import Budget
from megascale.resilience.driver.api_server import ApiServer, Limits, Route
from megascale.resilience.driver.driver import Driver
from megascale.resilience.driver.identity import JOIN, NODE, OPERATOR, Identities, for_node, for_operator, registration
from megascale.resilience.driver.local import Netns, netns_available, netns_down, netns_up, spawn_executor
from megascale.resilience.driver.placement import PlacementError, layout_for
from megascale.resilience.driver.roster import Roster, load_roster, local_roster
from megascale.resilience.driver.state import FINISHED, JobState, JobStore

if TYPE_CHECKING:
    from megascale.resilience.common.redis_server import RedisServer

log = logging.getLogger("megascale.driver")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config of the training job")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the job trains on")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--spares", type=int, default=None, help="spare nodes (default resilience.spares)")
    parser.add_argument(
        "--external", action="store_true", help="cluster mode: do not start executors; wait for them to register"
    )
    parser.add_argument(
        "--netns", action="store_true", help="local mode: each simulated node in its own network namespace (root)"
    )
    parser.add_argument(
        "--topology",
        metavar="SOURCE",
        help="order the nodes by the planner's placement: file:HOSTS (name tor [pod]),"
        " slurm[:FILE] (scontrol show topology) or k8s:NODES.json[#tor=LABEL]",
    )
    parser.epilog = "Training options as --section.key=value, e.g. --model.layers=2 --train.steps=100"


def check_before_start(cfg: JobConfig, nodes: int, ranks_per_node: int) -> None:
    """Everything that would make every rank fail, found before any rank starts."""
    ck = cfg.checkpoint
    if ck.dir and "://" not in ck.dir and not Path(ck.dir).is_dir():
        raise ConfigError(
            f"checkpoint.dir={ck.dir!r} does not exist; create it or leave it empty (<run_dir>/checkpoints)"
        )
    if ck.resume not in ("auto", "none") and "://" not in ck.resume and not Path(ck.resume).exists():
        raise ConfigError(f"checkpoint.resume={ck.resume!r}: no such checkpoint")
    if nodes < 1 or ranks_per_node < 1:
        raise ConfigError("--nodes and --ranks-per-node must be >= 1")
    try:
        layout_for(cfg, nodes, ranks_per_node)
    except PlacementError as exc:
        raise ConfigError(f"--nodes {nodes} --ranks-per-node {ranks_per_node}: {exc}") from None
    check_memory_limit(cfg, cfg.train.device)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [driver] %(message)s")
    os.umask(0o077)
    try:
        cfg = load_config(args.config, args.overrides)
        check_before_start(cfg, args.nodes, args.ranks_per_node)
    except ConfigError as exc:
        print(f"megascale launch: config error: {exc}", file=sys.stderr)
        return 2
    if args.topology:
        from megascale.plan.apply import read_topology  # brings in torch: only when asked for

        try:
            read_topology(args.topology)
        except (ConfigError, OSError, subprocess.CalledProcessError) as exc:
            print(f"megascale launch: --topology {args.topology}: {exc}", file=sys.stderr)
            return 2
    if args.netns and (why := netns_available()):
        print(f"megascale launch: --netns unavailable: {why}", file=sys.stderr)
        return 2
    rcfg = cfg.resilience
    run_dir = Path(os.path.abspath(cfg.train.run_dir))  # not resolve(): a link here must be seen, not followed
    try:
        private_dir(run_dir)
        state_dir = private_dir(run_dir / "resilience")
    except UnsafePathError as exc:
        print(f"megascale launch: train.run_dir: {exc}", file=sys.stderr)
        return 2
    store = JobStore(state_dir / "driver.sqlite")
    state = store.load()
    if state is not None and state.phase in FINISHED:
        print(
            f"megascale launch: the job in {run_dir} already ended ({state.phase}: {state.reason}); "
            "use another train.run_dir",
            file=sys.stderr,
        )
        return 2
    continuing = state is not None
    spares = rcfg.spares if args.spares is None else args.spares
    if state is None:
        state = JobState(
            job_id=secrets.token_hex(4),
            nodes_wanted=args.nodes,
            ranks_per_node=args.ranks_per_node,
            layout=layout_for(cfg, args.nodes, args.ranks_per_node),
            train_config=config_text(cfg),
            run_dir=str(run_dir),
            restart_budget=rcfg.restart_budget,
        )
        state.api = {
            "netns": args.netns,
            "local": not args.external,
            "count": args.nodes + spares,
            "topology": args.topology,
        }
    try:  # local executors are node0...: no other id is one of the job's
        roster = local_roster(state.api["count"]) if state.api.get("local") else load_roster(rcfg.roster)
    except ConfigError as exc:
        print(f"megascale launch: config error: {exc}", file=sys.stderr)
        return 2
    netns = Netns(state.job_id[:4]) if state.api.get("netns") else None
    host = netns.bridge_address if netns and rcfg.api_host == "127.0.0.1" else rcfg.api_host
    try:
        secret = _job_secret(Path(rcfg.secret_dir) if rcfg.secret_dir else state_dir / "secret", host)
    except (SecretError, OSError) as exc:
        print(f"megascale launch: {exc}", file=sys.stderr)
        return 2
    if netns is not None and not continuing:
        netns_up(netns, state.api["count"])
    try:
        redis_server = _job_redis(cfg.parallel, state, continuing, state_dir)
    except (OSError, RuntimeError) as exc:  # no redis-server, it could not start, or its password file is unsafe
        print(f"megascale launch: {exc}", file=sys.stderr)
        return 2
    driver = Driver(cfg, state, store, roster)
    # every node of the job may connect at once (a registration storm), all through one address in
    # local mode: the cap on connections without a token yet is twice that, never below the
    # default, and an address-keyed caller (the join token) has the whole roster's budget
    nodes = state.nodes_wanted + spares
    limits = Limits(
        request_timeout_s=rcfg.api_request_timeout_s,
        handshake_timeout_s=rcfg.api_request_timeout_s,
        max_unauthenticated=max(Limits.max_unauthenticated, 2 * nodes),
        budget=Budget(per_address=nodes),
    )
    identities = Identities(secret, state.job_id)
    server = ApiServer(
        host,
        state.api.get("port") or rcfg.api_port,
        identities.authenticate,
        _routes(driver, identities, roster),
        server_context(secret),
        limits,
    ).start()
    url = server.url
    state.api.update(host=server.host, port=server.port, url=url, driver_pid=os.getpid())
    store.save(state)
    write_private(
        state_dir / "driver.json", json.dumps({"url": url, "pid": os.getpid(), "secret_dir": str(secret.directory)})
    )
    log.info(
        "%s job %s: driver at %s (secret in %s; at most %d connections)",
        "continuing" if continuing else "starting",
        state.job_id,
        url,
        secret.directory,
        server.cap,
    )
    executors = []
    if state.api.get("local"):
        executors = _start_local_executors(state, url, secret.directory, run_dir, netns)
        store.save(state)
    try:
        code = driver.run()
    except KeyboardInterrupt:
        driver.on_stop({"reason": "interrupted (Ctrl-C)"})
        driver.write_summary()
        code = 130
    finally:
        deadline = time.monotonic() + 15
        for proc in executors:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except Exception:
                proc.kill()
        server.close()
        if netns is not None and state.phase in FINISHED:
            netns_down(netns, state.api["count"])
        if redis_server is not None and state.phase in FINISHED:
            redis_server.stop()  # else a restarted driver adopts it, with the attempt's keys
    print(json.dumps(driver.summary(), default=str))
    return code


def _routes(driver: Driver, identities: Identities, roster: Roster | None) -> dict[tuple[str, str], Route]:
    """The API: each route's handler, the schema its body must pass first, and who may call it."""
    node, operator = frozenset({NODE}), frozenset({OPERATOR})
    return {
        ("POST", "/v1/register"): Route(
            registration(driver.on_register, identities, driver.rcfg.peer_address_check, roster),
            protocol.Register,
            frozenset({JOIN, NODE}),
        ),
        ("POST", "/v1/heartbeat"): Route(for_node(driver.on_heartbeat), protocol.Heartbeat, node, driver.lock),
        ("GET", "/v1/status"): Route(for_operator(driver.on_status), None, operator),
        ("POST", "/v1/evict"): Route(for_operator(driver.on_evict), protocol.Evict, operator),
        ("POST", "/v1/stop"): Route(for_operator(driver.on_stop), protocol.Stop, operator),
    }


def _job_secret(directory: Path, host: str) -> JobSecret:
    """The job's secret directory, made when missing (local and Slurm runs), checked in any case."""
    ensure_secret(directory, [host] if host not in ("0.0.0.0", "::") else [])
    return load_secret(directory, need_key=True)


def _job_redis(parallel: ParallelConfig, state: JobState, continuing: bool, state_dir: Path) -> RedisServer | None:
    """The job's redis-server when `parallel.redis_start` asks for one, always with a password
    (a generated one kept in the state directory when none is configured: a restarted driver
    uses it again); a restarted driver adopts the server its predecessor started instead of
    starting a second on the same port."""
    if not parallel.redis_start:  # checked here: the import below brings in torch
        return None
    if not parallel.redis_password():  # the driver, its `start`s and the server read it from the URL
        parallel.redis_url = with_generated_password(parallel.redis_url, state_dir / "redis_password")
    from megascale.resilience.common.redis_server import RedisServer

    server = RedisServer.for_job(parallel)
    pid = state.api.get("redis_pid")
    if continuing and pid and _alive(pid) and server.answers(pid):
        server.adopt(pid)
        log.info("adopted the job's redis-server (pid %d) at %s", pid, redacted_url(server.url))
    else:
        server.start()
        log.info("started redis-server (pid %d) for the job at %s", server.pid, redacted_url(server.url))
    state.api["redis_pid"] = server.pid
    return server


def _start_local_executors(state: JobState, url: str, secret_dir: Path, run_dir: Path, netns: Netns | None) -> list:
    """One executor per simulated node, except those still alive from a previous driver."""
    procs = []
    pids = state.api.setdefault("executor_pids", {})
    for i in range(state.api["count"]):
        pid = pids.get(str(i))
        if pid and _alive(pid):
            continue
        proc = spawn_executor(i, url, secret_dir, run_dir / "executors", netns, run_dir / "executors" / f"node{i}.log")
        pids[str(i)] = proc.pid
        procs.append(proc)
    return procs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
