"""In-memory redundancy: every K steps each rank's state is copied into a rank on another node.

A copy is what stage 2 would write for the rank, taken whole: the rank's data file (every piece
it holds, its RNG arrays) and its index (records, optimizer scalars, RNG and loader metadata),
as a header sealed like a manifest (`manifest.seal`: a sha256 of the data and a checksum of the
header itself). Rank r sends its copy to the same local rank on the next node of the ring
(`checkpoint.peer_stride` nodes on: at scale, past its switch) and keeps its own; the two newest
generations (step, attempt) are kept of each, so that a round in progress when a fault strikes
never leaves the job without a complete one.

A replacement rank restores from those copies over the network, never from storage: the ranks
agree on the newest generation that every rank's file is held for (same step, same attempt: a
mixed, stale or partial set is never used), build a manifest from the copies' headers (checked
by `manifest.validate`, as a stored one), and run the ordinary `restore` with the files taken
from memory; their sizes and sha256 are checked there as any file read from storage. A copy that
fails a check is never used: the next generation, or storage, is tried.

The copies travel on gloo groups of their own (`ParallelMesh.replica_groups`: twins of the rank's
tp, dp and pp groups, routed as the checkpoint's, `checkpoint.comm`), sent by a background
thread, so the training step only pays for the memory copy and no rank links to the world.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, ValidationError

from megascale.checkpoint.comm import Comm
from megascale.checkpoint.manifest import (
    FORMAT,
    VERSION,
    Layout,
    RankMeta,
    Scalar,
    Strict,
    TensorRecord,
    check_records,
    checksum,
    seal,
)
from megascale.checkpoint.snapshot import layout
from megascale.checkpoint.state import record_of, rng_pieces, shared_pieces
from megascale.checkpoint.stateful import CheckpointState
from megascale.checkpoint.storage import CheckpointError, data_file

log = logging.getLogger("megascale.checkpoint")
COPY_FORMAT = "megascale-peer-copy"
KEEP = 2  # generations kept of the rank's own state and of the copy it holds
Generation = tuple[int, int]  # (step, attempt that captured it)


class CopyHeader(Strict):
    format: Literal[COPY_FORMAT]  # type: ignore[valid-type]
    rank: Annotated[int, Field(ge=0)]
    step: Annotated[int, Field(ge=0)]
    attempt: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    layout: Layout
    size: Annotated[int, Field(ge=0)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    records: list[TensorRecord]
    plain: dict[str, dict[str, Scalar]]
    meta: RankMeta
    checksum: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Holding(Strict):
    """What a rank says it holds (`ReplicaStore.holdings`), as rank 0 reads it."""

    step: Annotated[int, Field(ge=0)]
    attempt: Annotated[int, Field(ge=0)]
    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    layout: dict[str, int]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


@dataclass
class Copy:
    """One rank's state at one step: a sealed header and the bytes of its data file."""

    header: dict[str, Any]
    data: bytearray

    @property
    def generation(self) -> Generation:
        return (self.header["step"], self.header["attempt"])

    @property
    def rank(self) -> int:
        return self.header["rank"]

    @property
    def name(self) -> str:
        return data_file(self.rank)


def capture(state: CheckpointState, rank: int, attempt: int, world: int, grid_layout: dict[str, int]) -> Copy:
    """Copy this rank's whole state into host memory (the only part on the training path);
    the header is sealed later, off the critical path (`sealed`)."""
    pieces, plain = shared_pieces(state)
    rng, rng_meta = rng_pieces(rank, state.rng.state_dict())
    written = pieces + rng
    offsets, nbytes = layout([p.tensor for p in written])
    data = bytearray(nbytes)
    if nbytes:
        host = torch.frombuffer(data, dtype=torch.uint8)
        for piece, offset in zip(written, offsets, strict=True):
            size = piece.tensor.numel() * piece.tensor.element_size()
            host[offset : offset + size].view(piece.tensor.dtype).view(piece.tensor.shape).copy_(piece.tensor.detach())
    records = [dict(record_of(p, off), file=data_file(rank)) for p, off in zip(written, offsets, strict=True)]
    header = {
        "format": COPY_FORMAT,
        "rank": rank,
        "step": state.step,
        "attempt": attempt,
        "world_size": world,
        "layout": grid_layout,
        "size": nbytes,
        "records": records,
        "plain": plain,
        "meta": {"rng": rng_meta, "loader": state.loader.state_dict()},
    }
    return Copy(header, data)


def sealed(copy: Copy) -> Copy:
    """The copy with its data's sha256 and the header's own checksum."""
    return Copy(seal(dict(copy.header, sha256=hashlib.sha256(copy.data).hexdigest())), copy.data)


def verify(header: Any, data: bytearray, rank: int | None = None, generation: Generation | None = None) -> Copy:
    """The copy if it is whole and what was expected; CheckpointError naming the defect if not."""
    where = f"peer copy of rank {rank if rank is not None else '?'}"
    if not isinstance(header, dict) or header.get("format") != COPY_FORMAT:
        raise CheckpointError(f"{where}: not a {COPY_FORMAT} header")
    try:
        parsed = CopyHeader.model_validate(header)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CheckpointError(
            f"{where}: header does not fit the schema ({'.'.join(map(str, first['loc']))}: {first['msg']})"
        ) from None
    if checksum(header) != parsed.checksum:
        raise CheckpointError(f"{where}: header changed after it was sealed (checksum mismatch)")
    if rank is not None and parsed.rank != rank:
        raise CheckpointError(f"{where}: it is rank {parsed.rank}'s")
    if generation is not None and (parsed.step, parsed.attempt) != generation:
        raise CheckpointError(
            f"{where}: step {parsed.step} of attempt {parsed.attempt}, expected "
            f"step {generation[0]} of attempt {generation[1]} (stale or mixed)"
        )
    if len(data) != parsed.size:
        raise CheckpointError(f"{where}: {len(data)} bytes, the header says {parsed.size} (partial)")
    if hashlib.sha256(data).hexdigest() != parsed.sha256:
        raise CheckpointError(f"{where}: sha256 mismatch (corrupt)")
    check_records(parsed.records, {data_file(parsed.rank): parsed.size}, where)
    return Copy(header, data)


class ReplicaStore:
    """The copies one rank process keeps: its own and the one it holds for a rank of the
    previous node. It outlives the trainer: a rank that stays alive through a recovery keeps it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.own: dict[Generation, Copy] = {}
        self.held: dict[Generation, Copy] = {}

    def keep(self, copy: Copy, mine: bool) -> None:
        with self._lock:
            kept = self.own if mine else self.held
            kept[copy.generation] = copy
            for old in sorted(kept)[:-KEEP]:
                del kept[old]

    def discard_after(self, step: int) -> None:
        """Copies of steps past a restored one belong to an abandoned timeline."""
        with self._lock:
            for kept in (self.own, self.held):
                for gen in [g for g in kept if g[0] > step]:
                    del kept[gen]

    def forget(self, generations: set[Generation]) -> None:
        """Drop generations found unusable (a copy failed its checks on some rank)."""
        with self._lock:
            for kept in (self.own, self.held):
                for gen in generations & kept.keys():
                    del kept[gen]

    def holdings(self) -> list[dict[str, Any]]:
        with self._lock:
            copies = [*self.own.values(), *self.held.values()]
        return [
            {
                "step": c.header["step"],
                "attempt": c.header["attempt"],
                "rank": c.rank,
                "world_size": c.header["world_size"],
                "layout": c.header["layout"],
                "sha256": c.header["sha256"],
            }
            for c in copies
        ]

    def files(self, generation: Generation) -> dict[str, Copy]:
        with self._lock:
            return {c.name: c for kept in (self.own, self.held) for g, c in kept.items() if g == generation}


def choose(
    holdings: list[list[dict[str, Any]]], world: int, grid_layout: dict[str, int], skip: set[Generation] = frozenset()
) -> tuple[Generation, dict[str, int]] | None:
    """The newest generation with every rank's file held somewhere for this layout, and who
    reads each file (its own rank when it holds it, else the lowest rank holding it)."""
    holders: dict[Generation, dict[int, list[int]]] = {}
    for holder, held in enumerate(holdings):
        for h in held:
            gen = (h["step"], h["attempt"])
            if h["world_size"] == world and h["layout"] == grid_layout and 0 <= h["rank"] < world:
                holders.setdefault(gen, {}).setdefault(h["rank"], []).append(holder)
    for gen in sorted(holders, reverse=True):
        if gen in skip or len(holders[gen]) < world:
            continue
        readers = {data_file(r): (r if r in ranks else min(ranks)) for r, ranks in holders[gen].items()}
        return gen, readers
    return None


def build_manifest(
    headers: list[dict[str, Any]],
    generation: Generation,
    world: int,
    grid_layout: dict[str, int],
    config: dict[str, Any],
    run_id: str,
) -> dict[str, Any]:
    """A checkpoint manifest of one generation's copies (one per rank), sealed. Replicated pieces
    are listed once (the lowest rank's), as stage 2 writes them."""
    by_rank = {h["rank"]: h for h in headers}
    if sorted(by_rank) != list(range(world)) or any((h["step"], h["attempt"]) != generation for h in headers):
        raise CheckpointError(f"peer copies of step {generation[0]} do not cover ranks 0-{world - 1} at one step")
    files, tensors, ranks, plain, seen = {}, [], {}, {}, set()
    for rank in range(world):
        h = by_rank[rank]
        files[data_file(rank)] = {"size": h["size"], "sha256": h["sha256"]}
        for rec in h["records"]:
            key = (rec["param"], rec["field"], json.dumps(rec["spec"], sort_keys=True))
            if key not in seen:
                seen.add(key)
                tensors.append(rec)
        ranks[str(rank)] = h["meta"]
        plain.update(h["plain"])
    return seal(
        {
            "format": FORMAT,
            "version": VERSION,
            "step": generation[0],
            "seq": 1,
            "world_size": world,
            "layout": grid_layout,
            "config": config,
            "created": time.time(),
            "run_id": run_id,
            "torch": torch.__version__,
            "files": files,
            "tensors": tensors,
            "ranks": ranks,
            "plain": plain,
        }
    )


class PeerReplicator:
    """Every `every` steps: capture this rank's copy, then (in the background) seal it, send it to
    the same local rank of the next node and take the previous node's, checked before it is kept."""

    def __init__(
        self, store: ReplicaStore, comm: Comm, offset: int, every: int, attempt: int, grid_layout: dict[str, int]
    ) -> None:
        """`offset`: ranks between this rank and the one keeping its copy (whole nodes along the ring);
        `comm`: over the replica groups, used by this object's thread only."""
        self.store, self.comm, self.rank, self.world = store, comm, comm.rank, comm.world
        self.every, self.attempt, self.layout = every, attempt, grid_layout
        self.successor = (self.rank + offset) % self.world
        self.predecessor = (self.rank - offset) % self.world
        self._thread: threading.Thread | None = None

    def after_step(self, state: CheckpointState) -> None:
        if self.every <= 0 or state.step % self.every:
            return
        self.wait()  # rounds never overlap: every rank sends and receives them in the same order
        copy = capture(state, self.rank, self.attempt, self.world, self.layout)
        self._thread = threading.Thread(
            target=self._round, args=(copy,), daemon=True, name=f"megascale-peer-copy-{self.rank}"
        )
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _round(self, copy: Copy) -> None:
        own = sealed(copy)
        self.store.keep(own, mine=True)
        try:
            header, data = self._exchange(json.dumps(own.header).encode(), own.data)
            held = verify(json.loads(header), data, self.predecessor, own.generation)
        except (RuntimeError, ValueError, CheckpointError) as exc:  # a peer gone mid-copy, a bad copy
            log.warning(
                "peer copy of step %d: %s; the copy held for rank %d is not updated",
                own.header["step"],
                exc,
                self.predecessor,
            )
            return
        self.store.keep(held, mine=False)

    def _exchange(self, header: bytes, data: bytearray) -> tuple[bytes, bytearray]:
        """Send (header, data) to the successor, return the predecessor's: one routed message."""
        message = torch.cat(
            [_bytes(bytearray(len(header).to_bytes(8, "little"))), _bytes(bytearray(header)), _bytes(data)]
        )
        got = self.comm.exchange({self.successor: message})
        if self.predecessor not in got or got[self.predecessor].numel() < 8:
            raise CheckpointError(f"no copy came from rank {self.predecessor}")
        raw = got[self.predecessor]
        size = int.from_bytes(raw[:8].numpy().tobytes(), "little")
        return raw[8 : 8 + size].numpy().tobytes(), bytearray(raw[8 + size :].numpy().tobytes())


def _bytes(buffer: bytearray) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
