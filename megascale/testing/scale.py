"""One size of the driver scale measurement: a real driver process, N simulated executors.

`run_size(N)` starts `megascale launch --external` for N nodes of 8 ranks (the configured 1 s
heartbeat and 5 s timeout), runs `simnodes.Fleet` against it and returns what bench/scale.py
records and tests/resilience/test_driver_live_scale.py checks: registration of all N at once
(wall, and the driver's CPU per registration), a steady window of heartbeats (the driver's CPU
per heartbeat and its share of a core, round-trip p50/p99, RSS, a status call), then one node
falls silent: the time until the driver acts on it (the first recovery command another node
receives) and every fault it raised (false faults: any but that one). CPU is read from /proc.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megascale.resilience.common.api import ApiClient, ApiError
from megascale.resilience.common.credentials import load_secret
from megascale.testing.simnodes import Fleet

REPO = Path(__file__).resolve().parents[2]
RANKS_PER_NODE = 8


def driver_args(run_dir: Path, nodes: int, extra: list[str]) -> list[str]:
    world = nodes * RANKS_PER_NODE
    return [
        sys.executable,
        "-m",
        "megascale.cli",
        "launch",
        "--external",
        "--nodes",
        str(nodes),
        "--ranks-per-node",
        str(RANKS_PER_NODE),
        f"--parallel.dp={world}",
        f"--train.global_batch={world}",
        "--train.micro_batch=1",
        "--train.steps=1000000000",
        "--resilience.hang_floor_s=600",
        "--resilience.startup_timeout_s=300",
        "--resilience.in_place=true",
        f"--train.run_dir={run_dir}",
        "--resilience.peer_address_check=false",  # simulated nodes claim 10.x addresses from loopback
        *extra,
    ]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def status_of(client: ApiClient, tries: int = 30) -> dict[str, Any]:
    """GET /v1/status, again after a second when the driver sheds load (503), as executors do."""
    for attempt in range(tries):
        try:
            return await asyncio.to_thread(client.status)
        except ApiError as exc:
            if exc.status != 503 or attempt == tries - 1:
                raise
            await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


async def measure(
    fleet: Fleet, pid: int, client: ApiClient, window_s: float, nodes: int, timeout_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes}
    cpu0 = cpu_s(pid)
    out["register_s"] = await fleet.registered(timeout_s=300)
    out["driver_cpu_per_registration_ms"] = 1e3 * (cpu_s(pid) - cpu0) / nodes
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(any(k == "start" for _, k in n.stats.commands) for n in fleet.nodes):
        await asyncio.sleep(0.1)  # every node has had its `start` (or a recovery began: counted below)
    await asyncio.sleep(3.0)  # past the start: heartbeats at their steady rate
    out["harness_lag_max_s_at_start"], fleet.lag_max = fleet.lag_max, 0.0
    marks, beats, cpu1, wall1 = fleet.marks(), fleet.heartbeats(), cpu_s(pid), time.monotonic()
    await asyncio.sleep(window_s)
    cpu, wall, count = cpu_s(pid) - cpu1, time.monotonic() - wall1, fleet.heartbeats() - beats
    rtts = fleet.rtts_since(marks)
    started = time.monotonic()
    status = await status_of(client)
    out["status_bytes"] = len(json.dumps(status))
    out.update(
        heartbeats=count,
        heartbeats_per_s=count / wall,
        driver_cpu_share=cpu / wall,
        driver_cores_at_1_hz=cpu / wall * nodes / max(count / wall, 1e-9),  # scaled to N beats/s
        driver_cpu_per_heartbeat_ms=1e3 * cpu / max(count, 1),
        rtt_p50_ms=1e3 * pct(rtts, 0.5),
        rtt_p99_ms=1e3 * pct(rtts, 0.99),
        driver_rss_mb=rss_mb(pid),
        status_s=time.monotonic() - started,
        false_faults_before_silence=len(status["faults"]),
        connection_errors=sum(len(n.stats.errors) for n in fleet.nodes),
        harness_lag_max_s=fleet.lag_max,
    )
    victim = fleet.nodes[0]
    victim.silent.set()
    acted = None
    deadline = time.monotonic() + 60
    while acted is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        acted = min(
            (t for n in fleet.nodes[1:] for t, kind in n.stats.commands if kind in ("pause", "stop")), default=None
        )
    out["detect_silent_node_s"] = None if acted is None else acted - victim.last_ok  # from its last answered beat
    await asyncio.sleep(1.0)
    faults = (await status_of(client))["faults"]
    out["faults_after_silence"] = [(f["kind"], f.get("node")) for f in faults]
    out["detect_after_timeout_s"] = (
        None if out["detect_silent_node_s"] is None else out["detect_silent_node_s"] - timeout_s
    )
    out["false_faults"] = out["false_faults_before_silence"] + sum(
        1 for f in faults if (f["kind"], f.get("node")) != ("heartbeat_lost", victim.node_id)
    )
    return out


def run_size(
    nodes: int, window_s: float, extra: list[str], repo: Path = REPO, heartbeat_timeout_s: float = 5.0
) -> dict[str, Any]:
    """`heartbeat_timeout_s` above the default only where the simulated nodes themselves cannot
    beat in time on this machine (recorded with the result)."""
    extra = [*extra, f"--resilience.heartbeat_timeout_s={heartbeat_timeout_s}"]
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        run_dir = Path(tmp) / "run"
        log = open(Path(tmp) / "driver.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            driver_args(run_dir, nodes, extra),
            cwd=repo,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)},
        )
        try:
            while not (run_dir / "resilience" / "driver.json").is_file():
                if proc.poll() is not None:
                    raise RuntimeError((Path(tmp) / "driver.log").read_text()[-3000:])
                time.sleep(0.05)
            info = json.loads((run_dir / "resilience" / "driver.json").read_text())
            secret = load_secret(info["secret_dir"], need_key=True)  # the operator token, for status
            fleet = Fleet(info["url"], secret.token, secret.cert_pem, nodes, RANKS_PER_NODE)
            client = ApiClient(info["url"], secret.operator or secret.token, secret.cert_pem, timeout_s=60)
            harness0 = time.process_time()
            result = asyncio.run(
                fleet.run(lambda f: measure(f, proc.pid, client, window_s, nodes, heartbeat_timeout_s))
            )
            result["heartbeat_timeout_s"] = heartbeat_timeout_s
            result["harness_cpu_s"] = time.process_time() - harness0
            return result
        finally:
            proc.kill()
            proc.wait()
            log.close()
