"""Really slowing a simulated node, for fail-slow tests and benchmarks: a CPU quota, a slow link.

A CPU quota (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` where the machine mounts v1) on a
node's processes -- its executor and everything under it, ranks and warm standbys -- caps the
CPU they get together, as a throttled or thermally limited machine would; processes started
later inherit it. A token-bucket rate limit (`tc ... tbf`) on both ends of a namespaced node's
veth slows its link (netem, the usual delay qdisc, is not in every kernel: tbf is the fallback
that is). Both need root; `*_available()` says why not when they cannot be used.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import psutil

from megascale.resilience.driver.local import Netns

CGROUP = Path("/sys/fs/cgroup")
PERIOD_US = 20_000  # short periods: a quota slows even a test of a few hundred milliseconds evenly


def _cpu_root() -> tuple[Path, int] | None:
    """The cgroup directory under which a CPU-limited group can be made, and the version."""
    if (CGROUP / "cgroup.controllers").is_file() and "cpu" in (CGROUP / "cgroup.controllers").read_text().split():
        return CGROUP, 2
    if (CGROUP / "cpu" / "cpu.cfs_quota_us").is_file():
        return CGROUP / "cpu", 1
    return None


def cpu_quota_available() -> str | None:
    if os.geteuid() != 0:
        return "a CPU quota needs root (cgroups)"
    if _cpu_root() is None:
        return "no cgroup CPU controller is mounted (neither v2 cpu.max nor v1 cpu.cfs_quota_us)"
    return None


def tree(pid: int) -> list[int]:
    """PID and all its descendants."""
    try:
        parent = psutil.Process(pid)
        return [pid, *(c.pid for c in parent.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


class CpuQuota:
    """`cores` CPUs at most for the processes moved in (`add`), until `close` moves them back."""

    def __init__(self, name: str, cores: float) -> None:
        found = _cpu_root()
        if found is None or os.geteuid() != 0:
            raise RuntimeError(cpu_quota_available())
        self.root, self.version = found
        if self.version == 2:
            with contextlib.suppress(OSError):  # let children have a cpu controller
                (self.root / "cgroup.subtree_control").write_text("+cpu")
        self.path = self.root / name
        self.path.mkdir(exist_ok=True)
        self.set(cores)

    def set(self, cores: float) -> None:
        quota = max(int(cores * PERIOD_US), 1000)  # the kernel's minimum: 1 ms a period
        if self.version == 2:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, pids: list[int]) -> int:
        """Move processes in (all their threads); returns how many were moved."""
        moved = 0
        for pid in pids:
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
                moved += 1
            except OSError:  # gone meanwhile
                continue
        return moved

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (self.root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cpu_rates(pids: list[int], seconds: float) -> list[float]:
    """Cores each process used over the same `seconds` (what it actually gets on a shared machine)."""
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]

    def used(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    before = [used(p) for p in procs]
    time.sleep(seconds)
    return [(used(p) - b) / seconds for p, b in zip(procs, before, strict=True)]


def _tc(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["tc", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def slow_link(spec: Netns, i: int, mbit: float | None) -> None:
    """Rate-limit node i's link both ways to `mbit` (None: remove the limit)."""
    for dev, ns in ((spec.veth(i), None), ("eth0", spec.name(i))):
        if mbit is None:
            with contextlib.suppress(subprocess.CalledProcessError):
                _tc("qdisc", "del", "dev", dev, "root", ns=ns)
        else:
            burst = max(int(mbit * 1e6 / 8 / 250), 16 * 1024)  # ~4 ms of traffic, at least 16 KiB
            _tc(
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{mbit}mbit",
                "burst",
                str(burst),
                "latency",
                "200ms",
                ns=ns,
            )
