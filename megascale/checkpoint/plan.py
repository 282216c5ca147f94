"""The restore plan: made once, on rank 0, from an index of the manifest, and handed out in parts.

Rank 0 holds the validated manifest; every rank sends it the targets it must fill (parameter,
field, `ShardSpec`, dtype; JSON). Rank 0 indexes the records by (parameter, field) and by exact
piece, and in one pass decides:
- each data file gets one reader: the rank that wrote it while it still exists; files of ranks
  gone (a smaller world) go biggest first to the least-loaded rank (a heap);
- a target that is exactly a stored piece (same spec: an unchanged layout) comes straight from
  that piece's reader (its own file under ZeRO; the one stored copy for every dp rank when
  replicated);
- any other target (a changed layout) comes from its field's owner, one of the ranks that need it
  (the one that read most of it; ties, as under ZeRO, spread by a hash of the name): phase A
  sends it every stored piece, it puts the whole tensor together and phase B cuts each rank's piece;
- RNG arrays go to the rank they belong to.
It also refuses targets whose shape, dtype or coverage the checkpoint does not match. The plan is
then cut into one `Part` per rank holding only what that rank does, so rank 0's work is
O(records + targets) (dict indexes, one sort of the files) and no other rank sees more than its
own part: per-rank plan work does not grow with the world when the layout is unchanged.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import defaultdict
from typing import Any, Literal

from megascale.checkpoint.manifest import (
    DTYPE_SIZES,
    RNG,
    Count,
    DType,
    FileInfo,
    Layout,
    Name,
    RankMeta,
    Scalar,
    Spec,
    Strict,
    checkpoint_bytes,
)
from megascale.checkpoint.storage import CheckpointError
from megascale.layout.shard import ShardSpec


class Wanted(Strict):
    """One tensor a rank fills (its `Target`, as sent to rank 0)."""

    param: Name
    field: Name
    spec: Spec
    dtype: DType


class Outline(Strict):
    """What every rank learns first: enough to build its targets and install scalars."""

    step: Count
    world_size: Count
    layout: Layout
    model: dict[str, Any]
    plain: dict[Name, dict[Name, Scalar]]
    fields: dict[Name, list[Name]]
    manifest_bytes: Count
    stored_bytes: Count


class Send(Strict):
    dst: Count
    file: Name
    offset: Count
    nbytes: Count


class Incoming(Strict):
    """A stored piece arriving in phase A: into target `index`, into a whole this rank owns, or
    the rank's own RNG array."""

    src: Count
    kind: Literal["target", "piece", "rng"]
    index: Count
    param: Name
    field: Name
    spec: Spec | None
    dtype: DType
    shape: list[Count]
    nbytes: Count


class Owned(Strict):
    param: Name
    field: Name
    global_shape: list[Count]
    dtype: DType


class Cut(Strict):
    """Phase B: the piece `spec` of an owned whole, for rank `dst`."""

    dst: Count
    param: Name
    field: Name
    spec: Spec


class Fill(Strict):
    """Phase B: target `index` comes from owner `src`."""

    src: Count
    index: Count
    nbytes: Count


class Part(Strict):
    """One rank's share of the plan."""

    files: dict[Name, FileInfo]
    sends: list[Send]
    incoming: list[Incoming]
    owned: list[Owned]
    cuts: list[Cut]
    fills: list[Fill]
    meta: RankMeta
    own_meta: bool


def outline(manifest: dict) -> dict[str, Any]:
    fields: dict[str, set[str]] = defaultdict(set)
    for rec in manifest["tensors"]:
        if not rec["param"].startswith(RNG):
            fields[rec["param"]].add(rec["field"])
    return {
        "step": manifest["step"],
        "world_size": manifest["world_size"],
        "layout": manifest["layout"],
        "model": manifest["config"].get("model", {}),
        "plain": manifest["plain"],
        "fields": {p: sorted(f) for p, f in sorted(fields.items())},
        "manifest_bytes": manifest["manifest_bytes"],
        "stored_bytes": checkpoint_bytes(manifest),
    }


def assign_readers(files: dict[str, dict], world: int) -> dict[str, int]:
    """Each file's reader: its writer if that rank exists, else the least-loaded rank (biggest
    files first, so the load evens out); O(files log world)."""
    load = [0] * world
    heap = [(0, r) for r in range(world)]
    reader: dict[str, int] = {}
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        rank = writer_rank(name)
        if rank >= world:
            while heap[0][0] != load[heap[0][1]]:  # stale: that rank was given more since
                heapq.heappop(heap)
            rank = heap[0][1]
        reader[name] = rank
        load[rank] += files[name]["size"]
        heapq.heappush(heap, (load[rank], rank))
    return reader


def writer_rank(file: str) -> int:
    return int(file.split("-")[1].split(".")[0])


def spec_key(spec: dict | None) -> tuple:
    if spec is None:
        return ()
    flat = spec["flat_range"]
    return (
        tuple(spec["global_shape"]),
        spec["tp_dim"],
        spec["tp_rank"],
        spec["tp_size"],
        tuple(flat) if flat is not None else None,
    )


class Plan:
    """Rank 0's plan; `parts()` cuts it per rank. `visits` counts record and target visits (the
    scale test checks that it is linear in the checkpoint, whatever the world)."""

    def __init__(self, manifest: dict, wanted: list[list[dict]], readers: dict[str, int] | None = None):
        self.manifest, self.world = manifest, len(wanted)
        self.records: list[dict] = manifest["tensors"]
        self.reader = dict(readers) if readers is not None else assign_readers(manifest["files"], self.world)
        self.visits = 0
        by_field: dict[tuple[str, str], list[int]] = defaultdict(list)
        exact: dict[tuple, int] = {}
        for idx, rec in enumerate(self.records):
            if not rec["param"].startswith(RNG):
                by_field[(rec["param"], rec["field"])].append(idx)
                exact.setdefault((rec["param"], rec["field"], spec_key(rec["spec"])), idx)
        self.visits += len(self.records)
        self.by_field = by_field
        self._stored: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}
        self.direct: list[tuple[int, int, int]] = []  # (record, dst, target index)
        self.needers: dict[tuple[str, str], list[tuple[int, int, dict]]] = defaultdict(list)
        for dst, targets in enumerate(wanted):
            for i, t in enumerate(targets):
                key = (t["param"], t["field"])
                self._check(key, t)
                idx = exact.get((*key, spec_key(t["spec"])))
                if idx is not None:
                    self.direct.append((idx, dst, i))
                else:
                    self.needers[key].append((dst, i, t["spec"]))
            self.visits += len(targets)
        self.owner = {key: self._owner(key, needers) for key, needers in self.needers.items()}

    def _check(self, key: tuple[str, str], target: dict) -> None:
        """The stored pieces of `key` agree on shape and dtype, cover the whole tensor, and match
        the target's shape and dtype (a copy_ would cast silently)."""
        if key not in self._stored:
            pieces = self.by_field.get(key)
            if not pieces:
                raise CheckpointError(f"the checkpoint has no {key[1]!r} for parameter {key[0]!r}")
            first = self.records[pieces[0]]
            shape, dtype = tuple(first["spec"]["global_shape"]), first["dtype"]
            stored = 0
            for idx in pieces:
                rec = self.records[idx]
                if tuple(rec["spec"]["global_shape"]) != shape or rec["dtype"] != dtype:
                    raise CheckpointError(
                        f"the checkpoint's pieces of {key[0]!r} ({key[1]}) disagree: "
                        f"{list(shape)} {dtype} and {rec['spec']['global_shape']} {rec['dtype']}"
                    )
                stored += ShardSpec.from_json(rec["spec"]).valid_numel
            self.visits += len(pieces)
            if stored != math.prod(shape):
                raise CheckpointError(
                    f"the checkpoint's pieces of {key[0]!r} ({key[1]}) cover {stored} of {math.prod(shape)} elements"
                )
            self._stored[key] = (shape, dtype)
        shape, dtype = self._stored[key]
        if tuple(target["spec"]["global_shape"]) != shape:
            raise CheckpointError(
                f"parameter {key[0]!r} has shape {list(shape)} in the checkpoint but "
                f"{target['spec']['global_shape']} in this model"
            )
        if target["dtype"] != dtype:
            raise CheckpointError(
                f"parameter {key[0]!r} ({key[1]}) is {dtype} in the checkpoint but "
                f"{target['dtype']} in this model; a checkpoint loads only into its own dtype"
            )

    def _owner(self, key: tuple[str, str], needers: list[tuple[int, int, dict]]) -> int:
        read: dict[int, int] = defaultdict(int)
        for idx in self.by_field[key]:
            read[self.reader[self.records[idx]["file"]]] += self.records[idx]["nbytes"]
        self.visits += len(self.by_field[key])
        ranks = sorted({dst for dst, _, _ in needers})
        most = max(read[r] for r in ranks)
        tied = [r for r in ranks if read[r] == most]
        # ties (ZeRO: every dp rank read its shard) spread over the tied ranks: one rank owning every
        # parameter would send each whole tensor dp-1 times alone
        return tied[zlib.crc32(key[0].encode()) % len(tied)]

    def parts(self) -> dict[int, dict[str, Any]]:
        """Every rank's `Part` (as JSON-able dicts), built in one pass over the plan, in one
        global order, so that each sender's and receiver's lists of a pair agree."""
        ranks = self.manifest["ranks"]
        parts = {
            r: {
                "files": {},
                "sends": [],
                "incoming": [],
                "owned": [],
                "cuts": [],
                "fills": [],
                "meta": ranks.get(str(r), ranks["0"]),
                "own_meta": str(r) in ranks,
            }
            for r in range(self.world)
        }
        for name, rank in self.reader.items():
            parts[rank]["files"][name] = self.manifest["files"][name]

        def move(idx: int, dst: int, kind: str, index: int) -> None:
            rec = self.records[idx]
            src = self.reader[rec["file"]]
            parts[src]["sends"].append(
                {"dst": dst, "file": rec["file"], "offset": rec["offset"], "nbytes": rec["nbytes"]}
            )
            parts[dst]["incoming"].append(
                {
                    "src": src,
                    "kind": kind,
                    "index": index,
                    "param": rec["param"],
                    "field": rec["field"],
                    "spec": rec["spec"],
                    "dtype": rec["dtype"],
                    "shape": rec["shape"],
                    "nbytes": rec["nbytes"],
                }
            )

        for idx, dst, i in self.direct:
            move(idx, dst, "target", i)
        for idx, rec in enumerate(self.records):
            if rec["param"].startswith(RNG) and int(rec["param"][len(RNG) :]) < self.world:
                move(idx, int(rec["param"][len(RNG) :]), "rng", 0)
        for key, needers in self.needers.items():
            owner = self.owner[key]
            shape, dtype = self._stored[key]
            parts[owner]["owned"].append(
                {"param": key[0], "field": key[1], "global_shape": list(shape), "dtype": dtype}
            )
            for idx in self.by_field[key]:
                move(idx, owner, "piece", 0)
            for dst, i, spec in needers:
                parts[owner]["cuts"].append({"dst": dst, "param": key[0], "field": key[1], "spec": spec})
                nbytes = ShardSpec.from_json(spec).numel * DTYPE_SIZES[dtype]
                parts[dst]["fills"].append({"src": owner, "index": i, "nbytes": nbytes})
        return parts


def part_size(part: dict[str, Any]) -> int:
    """Entries of a rank's part: the metadata it receives and walks (the scale test's work count)."""
    return sum(len(part[k]) for k in ("files", "sends", "incoming", "owned", "cuts", "fills"))
