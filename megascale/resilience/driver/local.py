"""Local mode: simulated nodes on this machine, one executor process each.

With `netns`, node i lives in its own network namespace `ms<job>-<i>` with address
10.<net>.0.(10+i) on a veth whose host end sits on a bridge at 10.<net>.0.1 (where the driver
listens); taking the namespace's link down cuts that node off like a pulled cable. Setting up
namespaces needs root and `ip` (scripts/netns.sh wraps the same commands for manual use).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from megascale.config.schema import REDIS_PASSWORD_ENV


@dataclass(frozen=True)
class Netns:
    """Names and addresses of one job's simulated-node namespaces."""

    tag: str  # short, unique per job (interface names are limited to 15 characters)
    net: int | None = None  # second octet of 10.<net>.0.0/24; None: 100-199, chosen by the tag

    @property
    def octet(self) -> int:
        """Two local jobs at once (two users, two test workers) must not route one subnet to
        two bridges: each job's tag picks its own."""
        return self.net if self.net is not None else 100 + zlib.crc32(self.tag.encode()) % 100

    @property
    def bridge(self) -> str:
        return f"msbr{self.tag}"

    @property
    def bridge_address(self) -> str:
        return f"10.{self.octet}.0.1"

    def name(self, i: int) -> str:
        return f"ms{self.tag}-{i}"

    def veth(self, i: int) -> str:
        return f"msv{self.tag}{i}"

    def address(self, i: int) -> str:
        return f"10.{self.octet}.0.{10 + i}"


def netns_available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=check, capture_output=True, text=True)


def netns_up(spec: Netns, count: int) -> None:
    netns_down(spec, count)
    _ip("link", "add", spec.bridge, "type", "bridge")
    _ip("addr", "add", f"{spec.bridge_address}/24", "dev", spec.bridge)
    _ip("link", "set", spec.bridge, "up")
    for i in range(count):
        ns, host_end = spec.name(i), spec.veth(i)
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", host_end, "master", spec.bridge)
        _ip("link", "set", host_end, "up")
        _ip("addr", "add", f"{spec.address(i)}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)


def netns_down(spec: Netns, count: int) -> None:
    for i in range(count):
        subprocess.run(["ip", "netns", "del", spec.name(i)], capture_output=True)
        _ip("link", "del", spec.veth(i), check=False)
    _ip("link", "del", spec.bridge, check=False)


def cut_link(spec: Netns, i: int, up: bool = False) -> None:
    """Take node i's link down (or up again): its traffic and heartbeats stop."""
    _ip("link", "set", "eth0", "up" if up else "down", ns=spec.name(i))


def spawn_executor(
    index: int, driver_url: str, secret_dir: Path, workdir: Path, netns: Netns | None, log_path: Path
) -> subprocess.Popen:
    node_id = f"node{index}"
    cmd = [
        sys.executable,
        "-m",
        "megascale.cli",
        "executor",
        "--driver",
        driver_url,
        "--secret-dir",
        str(secret_dir),
        "--node-id",
        node_id,
        "--workdir",
        str(workdir / node_id),
    ]
    env = {k: v for k, v in os.environ.items() if k != REDIS_PASSWORD_ENV}  # it comes with `start`
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns.name(index), *cmd, "--address", netns.address(index)]
        env["GLOO_SOCKET_IFNAME"] = "eth0"
    else:
        cmd += ["--address", "127.0.0.1", "--shared-network"]
        env["GLOO_SOCKET_IFNAME"] = "lo"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )


def main(argv: list[str]) -> int:
    """`python -m megascale.resilience.driver.local up|down TAG COUNT` / `cut|restore TAG INDEX`."""
    if len(argv) != 3 or argv[0] not in ("up", "down", "cut", "restore"):
        print("usage: up|down TAG COUNT  or  cut|restore TAG INDEX", file=sys.stderr)
        return 2
    if why := netns_available():
        print(f"netns: {why}", file=sys.stderr)
        return 1
    action, spec, number = argv[0], Netns(argv[1]), int(argv[2])
    if action in ("up", "down"):
        (netns_up if action == "up" else netns_down)(spec, number)
    else:
        cut_link(spec, number, up=action == "restore")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
