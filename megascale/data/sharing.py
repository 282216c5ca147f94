"""Redundant loader elimination: who reads from disk, and the start-up handshake.

Ranks of one host that need tokens (first and last pipeline stages) form reader groups:
`node` puts them all in one group, `tp` makes one group per tensor-parallel group, `rank`
makes none (every rank reads for itself). A group's lowest rank reads the batches of every dp
rank in the group into a `StepRing`; the others copy their slice out of it. The handshake goes
through the job's store (a few keys per local rank, no collective), so it works with any
backend and needs no extra process group.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megascale.data.shards import DataError
from megascale.data.shm import StepRing


@dataclass(frozen=True)
class ReaderGroup:
    ranks: tuple[int, ...]  # global ranks sharing one reader; ranks[0] reads
    dp_ranks: tuple[int, ...]  # the dp ranks whose batches the reader fetches
    me: int  # this rank
    namespace: str  # store key prefix of this group

    @property
    def is_reader(self) -> bool:
        return self.me == self.ranks[0]

    @property
    def consumer_index(self) -> int:
        return self.ranks.index(self.me) - 1

    @property
    def consumers(self) -> int:
        return len(self.ranks) - 1


def job_store(mesh: Any) -> dist.Store | None:
    """The job's key-value store, or None when this process is alone."""
    if mesh is None or mesh.world_size == 1 or not dist.is_initialized():
        return None
    store = getattr(mesh, "store", None)
    return store if store is not None else dist.distributed_c10d._get_default_store()


def find_group(mode: str, mesh: Any, store: dist.Store, timeout: float) -> ReaderGroup | None:
    """This rank's reader group, or None when it reads alone (or needs no tokens)."""
    if mode == "rank":
        return None
    # this rank's calls in this store (an attempt's): equal on every rank, whichever attempts a
    # process lived through before (a rank that stays alive through a recovery has more)
    calls = store.add(f"megascale/data/calls/{mesh.rank}", 1)
    base = f"megascale/data/{calls}"
    needs = mesh.is_first_stage or mesh.is_last_stage
    host = socket.gethostname()
    info = {"dp": mesh.dp_rank, "tp": mesh.tp_rank, "pp": mesh.pp_rank, "needs": needs, "host": host}
    store.set(f"{base}/info/{mesh.rank}", json.dumps(info))
    if not needs:
        return None
    candidates = mesh.launch.node_ranks() or list(range(mesh.world_size))
    keys = [f"{base}/info/{r}" for r in candidates]
    store.wait(keys, timedelta(seconds=timeout))
    infos = {r: json.loads(store.get(k)) for r, k in zip(candidates, keys, strict=True)}
    members = [
        r
        for r, i in infos.items()
        if i["needs"] and i["host"] == host and (mode == "node" or (i["dp"], i["pp"]) == (mesh.dp_rank, mesh.pp_rank))
    ]
    if len(members) < 2:
        return None
    dp_ranks = tuple(sorted({infos[r]["dp"] for r in members}))
    return ReaderGroup(tuple(members), dp_ranks, mesh.rank, f"{base}/group{members[0]}")


def open_ring(
    group: ReaderGroup, store: dist.Store, slot_shape: tuple[int, ...], slots: int, timeout: float, error: str | None
) -> StepRing | None:
    """Create (reader) or attach (others) the group's ring; `error` is this rank's failure to
    open its data, passed on so that no rank of the group waits for a ring that never comes.
    The reader unlinks the segment's name once every consumer has mapped it."""
    ns, wait = group.namespace, timedelta(seconds=timeout)
    if group.is_reader:
        ring = None if error else StepRing.create(slot_shape, slots, group.consumers)
        store.set(f"{ns}/ring", json.dumps({"name": ring.name if ring else "", "error": error}))
        if ring is None:
            return None
        keys = [f"{ns}/attached/{r}" for r in group.ranks[1:]]
        try:
            store.wait(keys, wait)
            failures = [v for v in (store.get(k).decode() for k in keys) if v != "ok"]
        finally:
            ring.unlink()  # every consumer mapped it (or failed): no name left in /dev/shm
            store.set(f"{ns}/unlinked", "1")
        if failures:
            ring.close()
            raise DataError(f"a local rank could not open the data: {failures[0]}")
        return ring
    store.wait([f"{ns}/ring"], wait)
    posted = json.loads(store.get(f"{ns}/ring"))
    if error or posted["error"]:
        store.set(f"{ns}/attached/{group.me}", error or "reader failed")
        if error:
            return None
        raise DataError(f"the data reader (rank {group.ranks[0]}) failed: {posted['error']}")
    ring = StepRing.attach(posted["name"], slot_shape, slots, group.consumers, group.consumer_index)
    store.set(f"{ns}/attached/{group.me}", "ok")
    store.wait([f"{ns}/unlinked"], wait)  # so that no rank starts training with a name left
    return ring
