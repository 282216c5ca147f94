"""The node ids a job expects, each bound to the host it must connect from.

Why: outside local mode the join token alone decided who a node was, so the first join-token
holder to register an id the job expected got it (trust on first use); a compromised node could
take the ids of nodes that had not registered yet and leave the real ones refused. With a roster
(`resilience.roster = "file:PATH"`: the `megascale.sbatch` script writes Slurm's node list
there; on Kubernetes the StatefulSet's pod names), an id is a host: a registration of a listed
id is admitted only from that host's addresses (the TCP peer of the request, resolved names
compared as addresses), whoever holds the join token. Ids not on the roster (replacement nodes)
are a pool bounded by `resilience.spare_pool`, and each must be a name that resolves to the
address it connects from; any other id is refused with a 403 that says why. A listed id that is
registered already may register again with the join token from its host (its executor lost the
credential it was given: a new work directory, a resubmitted job), from nowhere else.

Local mode has a roster too (`node0`... of the job; every simulated node shares loopback, so
ids are not bound to addresses there) and no pool. Without `resilience.roster` outside local
mode, registration stays trust on first use within nodes + spares + the pool (docs/security.md).
The file is read at every driver start: a resubmitted Slurm job brings its new node list.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale.config import ConfigError

NODE_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:%@-]{0,252}$")  # protocol.Name
Reply = tuple[int, dict[str, Any]]


@dataclass(frozen=True)
class Roster:
    hosts: dict[str, str] = field(default_factory=dict)  # node id -> its host ("" = not bound)
    pool: bool = False  # ids beyond the roster may join (bounded by resilience.spare_pool)
    source: str = ""  # what it was read from, for messages

    def __contains__(self, node_id: str) -> bool:
        return node_id in self.hosts

    def binding(self, node_id: str, peer: str) -> Reply | None:
        """The refusal of a registration of `node_id` from the TCP peer `peer`, None to go on.
        Resolves names (blocking): call it in a handler thread, never under the driver's lock."""
        host = self.hosts.get(node_id)
        if host == "" or not peer:
            return None
        if host is not None:
            if canonical(peer) in addresses(host):
                return None
            return 403, {
                "error": f"node {node_id} is bound to {host} by the job's roster ({self.source}); this "
                f"request comes from {peer}, not from an address of {host}"
            }
        if not self.pool:
            return 403, {"error": f"node {node_id} is not a node of this job ({self.source})"}
        if canonical(peer) in addresses(node_id):
            return None
        return 403, {
            "error": f"node {node_id} is not on the job's roster ({self.source}), and a replacement "
            f"node's id must be a host name that resolves to the address it connects from ({peer})"
        }


def local_roster(count: int) -> Roster:
    """Local mode: `node0`... (nodes + spares), all on this machine, no pool."""
    return Roster({f"node{i}": "" for i in range(count)}, pool=False, source="local mode: node0...")


def load_roster(spec: str) -> Roster | None:
    """`resilience.roster`: "" (none) or "file:PATH", one node a line, `NODE_ID [HOST]` (HOST, a
    name or address the node connects from, defaults to the id itself; `#` starts a comment)."""
    if not spec:
        return None
    kind, _, path = spec.partition(":")
    if kind != "file" or not path:
        raise ConfigError(f'resilience.roster={spec!r}: expected "" or "file:PATH" (one `NODE_ID [HOST]` a line)')
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"resilience.roster={spec!r}: cannot read it: {exc}") from None
    hosts: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2 or not NODE_ID.match(fields[0]) or fields[0] in hosts:
            raise ConfigError(
                f"resilience.roster {path} line {number}: {line.strip()!r}: expected `NODE_ID [HOST]` with "
                "a new id of letters, digits and _.:%@-"
            )
        hosts[fields[0]] = fields[-1]
    if not hosts:
        raise ConfigError(f"resilience.roster {path} lists no node")
    return Roster(hosts, pool=True, source=f"resilience.roster {path}")


def canonical(address: str) -> str:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def addresses(address: str) -> set[str]:
    """The IP addresses `address` (an IP, or a name: resolved) stands for; none when unknown."""
    try:
        return {canonical(address)}
    except ValueError:
        pass
    try:
        return {canonical(str(info[4][0]).split("%")[0]) for info in socket.getaddrinfo(address, None)}
    except (OSError, ValueError):
        return set()
