"""Who is calling the driver: an operator, an executor joining, or one registered node.

Why: with one token for everyone, any executor could speak for any other (kill its ranks with a
forged report, take its commands, move the rendezvous to its own address) or stop the job. Three
credentials, each a bearer token inside the pinned TLS channel (`credentials.py`):

* operator (`operator` in the secret directory; the driver's and operators' copy only): status,
  evict, stop;
* join token (`token`, what every executor holds): registration of a node id that is not yet
  registered, and only as many as the job expects plus a bounded spare pool;
* node credential: HMAC-SHA256 over (job id, node id) with a key derived from the driver's TLS
  key, issued in the reply to the node's first registration. The executor keeps it in memory and
  in its private work directory on its node; every heartbeat and re-registration must carry it,
  and a node's credential speaks for that node only. The driver stores nothing per node: it
  recomputes the MAC, so a restarted driver (same secret, same job) accepts the same credentials.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megascale.resilience.common.credentials import JobSecret
from megascale.resilience.driver.roster import NODE_ID, Reply, Roster, addresses, canonical
from megascale.resilience.driver.state import EVICTED, JobState

OPERATOR, JOIN, NODE = "operator", "join", "node"


@dataclass(frozen=True)
class Principal:
    role: str  # OPERATOR, JOIN or NODE
    node: str | None = None  # the node a NODE credential speaks for
    address: str = ""  # where the request came from (the TCP peer), set by the API server


class Identities:
    """Issues node credentials and tells which principal a presented credential is."""

    def __init__(self, secret: JobSecret, job_id: str) -> None:
        if not secret.operator or not secret.node_key:
            raise ValueError("the driver needs the operator token and the TLS key (load_secret(need_key=True))")
        self._operator, self._join = secret.operator.encode(), secret.token.encode()
        self._key = hmac.new(secret.node_key, b"job\0" + job_id.encode(), hashlib.sha256).digest()

    def credential_for(self, node_id: str) -> str:
        tag = base64.urlsafe_b64encode(node_id.encode()).rstrip(b"=").decode()
        return f"node.{tag}.{self._mac(node_id)}"

    def authenticate(self, credential: bytes) -> Principal | None:
        """The principal `credential` proves, None for none (compared in constant time)."""
        if hmac.compare_digest(credential, self._operator):
            return Principal(OPERATOR)
        if hmac.compare_digest(credential, self._join):
            return Principal(JOIN)
        kind, _, rest = credential.partition(b".")
        tag, _, mac = rest.rpartition(b".")
        if kind != b"node" or not tag or len(tag) > 400:
            return None
        try:
            node = base64.urlsafe_b64decode(tag + b"=" * (-len(tag) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        if NODE_ID.match(node) and hmac.compare_digest(mac, self._mac(node).encode()):
            return Principal(NODE, node)
        return None

    def _mac(self, node_id: str) -> str:
        return hmac.new(self._key, node_id.encode(), hashlib.sha256).hexdigest()


def admission(
    state: JobState, roster: Roster | None, node_id: str, address: str, proven: bool, spare_pool: int
) -> Reply | None:
    """The refusal of a registration, None to admit it. A registered node may register again
    only with its own credential and from its address (the rendezvous of every attempt is an
    active node's address), or with the join token from its host when the roster binds it to
    one (an executor that lost its credential: a new work directory, a resubmitted Slurm job);
    a new id must be one the job expects: with a roster, one on it (its
    host checked before, `registration`) or at most `spare_pool` ids beyond it (where the
    roster has a pool); without one, at most `count` (nodes + spares) + `spare_pool` node ids
    over the job's life, evicted ones included."""
    known = state.nodes.get(node_id)
    if known is not None and known.role != EVICTED:
        bound = roster is not None and bool(roster.hosts.get(node_id))  # its host is its proof
        if not proven and not bound:
            return 403, {
                "error": f"node {node_id} is registered; only it may register again, with the "
                "credential the driver gave it"
            }
        if address != known.address:
            return 409, {
                "error": f"node {node_id} registered from {known.address}; another address ({address}) "
                "is refused: evict the node first"
            }
        return None
    if known is not None:
        return None  # the caller refuses an evicted node with its own message
    if roster is not None and node_id in roster:
        return None
    if roster is not None and not roster.pool:
        listed = list(roster.hosts)
        return 403, {
            "error": f"node {node_id} is not a node of this job (expected: {', '.join(listed[:8])}"
            f"{', ...' if len(listed) > 8 else ''})"
        }
    if roster is None:
        limit, taken = int(state.api.get("count", state.nodes_wanted)) + spare_pool, len(state.nodes)
        what = "node ids have registered", "nodes + spares + resilience.spare_pool"
    else:
        limit, taken = spare_pool, sum(1 for n in state.nodes if n not in roster)
        what = "node ids beyond the roster have registered", "resilience.spare_pool"
    if taken >= limit:
        return 403, {
            "error": f"node {node_id} refused: {taken} {what[0]}, the most this job admits ({what[1]} = {limit})"
        }
    return None


# ---------------------------------------------------------------------- route adapters
def for_node(handler: Callable[[dict[str, Any]], Reply]) -> Callable[[dict[str, Any], Principal], Reply]:
    """A node route: the body's node_id must be the node the credential speaks for."""

    def call(body: dict[str, Any], who: Principal) -> Reply:
        if who.role != NODE or who.node != body["node_id"]:
            return 403, {"error": f"this credential speaks for {who.node or 'no node'}, not for {body['node_id']}"}
        return handler(body)

    return call


def registration(
    handler: Callable[[dict[str, Any], bool], Reply],
    identities: Identities,
    peer_check: bool = True,
    roster: Roster | None = None,
) -> Callable[[dict[str, Any], Principal], Reply]:
    """The register route: with the join token (a new node) or the node's own credential; the
    reply carries the node's credential. `peer_check`: the address registered (every attempt's
    rendezvous is an active node's) must be the one the request comes from. `roster`: a listed
    id only from its host, another id only as a name of the address it comes from (`roster.py`;
    names resolved here, in a handler thread, not under the driver's lock)."""

    def call(body: dict[str, Any], who: Principal) -> Reply:
        if who.role == NODE and who.node != body["node_id"]:
            return 403, {"error": f"this credential speaks for {who.node}, not for {body['node_id']}"}
        if roster is not None and (refusal := roster.binding(body["node_id"], who.address)) is not None:
            return refusal
        if peer_check and who.address and canonical(who.address) not in addresses(body["address"]):
            return 403, {
                "error": f"node {body['node_id']} registers address {body['address']} but connects from "
                f"{who.address}; register the address the driver sees (behind NAT, set "
                "resilience.peer_address_check=false)"
            }
        status, reply = handler(body, who.role == NODE)
        if status == 200:
            reply = {**reply, "credential": identities.credential_for(body["node_id"])}
        return status, reply

    return call


def for_operator(handler: Callable[[dict[str, Any]], Reply]) -> Callable[[dict[str, Any], Principal], Reply]:
    return lambda body, who: handler(body)
