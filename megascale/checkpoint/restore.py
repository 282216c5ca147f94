"""Recovery: every stored byte is read once, whatever the layout, then sent where it is needed.

Every rank computes the same plan from the manifest and every rank's targets:
- each data file gets exactly one reader (the rank that wrote it when it still exists), which
  reads it whole and checks its size and sha256 in the same pass;
- each parameter gets one owner among the ranks that need it (the one that read most of it;
  ties, as under ZeRO where every dp rank read a shard, spread over the tied ranks);
- phase A: readers send each stored piece to its parameter's owner (RNG arrays go straight to
  the rank they belong to); owners put the pieces together into whole tensors;
- phase B: owners cut each rank's piece (`local_piece`, any tp/ZeRO layout) and send it.
With an unchanged layout and replicated dp, the owner is the reader and phase B is the
broadcast of the read data over the ranks that hold the same state.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from megascale.checkpoint.comm import Comm
from megascale.checkpoint.manifest import RNG, confined
from megascale.checkpoint.state import (
    Target,
    piece_numel,
    spec_from_json,
    spec_to_json,
    torch_dtype,
    valid_numel,
)
from megascale.checkpoint.storage import CheckpointError
from megascale.layout.shard import ShardSpec, local_piece, tp_slice


@dataclass(frozen=True)
class Record:
    """One stored tensor, as the manifest lists it."""

    param: str
    field: str
    spec: ShardSpec | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int

    @staticmethod
    def from_json(data: dict) -> Record:
        return Record(data["param"], data["field"], spec_from_json(data["spec"]),
                      torch_dtype(data["dtype"]), tuple(data["shape"]), data["file"],
                      data["offset"], data["nbytes"])

    @property
    def rng_rank(self) -> int | None:
        return int(self.param[len(RNG):]) if self.param.startswith(RNG) else None


@dataclass(frozen=True)
class InMemory:
    """Data files already in this process's memory (peer copies, `replica.py`): `files` are the
    ones this rank holds, `readers` says which rank holds each file of the manifest. They are
    checked against the manifest's sizes and sha256 exactly as files read from storage."""

    files: dict[str, memoryview]
    readers: dict[str, int]


@dataclass
class Restored:
    bytes_read: int
    rng: dict[str, torch.Tensor] = field(default_factory=dict)


def writer_rank(file: str) -> int:
    return int(file.split("-")[1].split(".")[0])


class Plan:
    """Who reads which file, who owns which parameter, what moves where (same on all ranks)."""

    def __init__(self, manifest: dict, wanted: list[list[tuple]],
                 specs: list[list[ShardSpec | None]], world: int, readers: dict[str, int] | None = None):
        self.records = [Record.from_json(r) for r in manifest["tensors"]]
        self.world = world
        self.saved: dict[tuple[str, str], list[Record]] = defaultdict(list)
        for rec in self.records:
            if rec.rng_rank is None:
                self.saved[(rec.param, rec.field)].append(rec)
        self.wanted, self.specs = wanted, specs
        self._check()
        self.reader = dict(readers) if readers is not None else self._assign_readers(manifest["files"])
        self.owner = self._assign_owners()

    def _check(self) -> None:
        needed: set[tuple[str, str]] = set()
        for keys, specs in zip(self.wanted, self.specs, strict=True):
            for (param, fld, _), spec in zip(keys, specs, strict=True):
                pieces = self.saved.get((param, fld))
                if not pieces:
                    raise CheckpointError(f"the checkpoint has no {fld!r} for parameter {param!r}")
                if pieces[0].spec.global_shape != spec.global_shape:
                    raise CheckpointError(
                        f"parameter {param!r} has shape {list(pieces[0].spec.global_shape)} in "
                        f"the checkpoint but {list(spec.global_shape)} in this model"
                    )
                needed.add((param, fld))
        for param, fld in needed:
            pieces = self.saved[(param, fld)]
            stored = sum(valid_numel(rec.spec) for rec in pieces)
            if stored != math.prod(pieces[0].spec.global_shape):
                raise CheckpointError(
                    f"the checkpoint's pieces of {param!r} ({fld}) cover {stored} of "
                    f"{math.prod(pieces[0].spec.global_shape)} elements"
                )

    def _assign_readers(self, files: dict[str, dict]) -> dict[str, int]:
        load = [0] * self.world
        reader: dict[str, int] = {}
        for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
            rank = writer_rank(name)
            if rank >= self.world:
                rank = min(range(self.world), key=lambda r: (load[r], r))
            reader[name] = rank
            load[rank] += files[name]["size"]
        return reader

    def _assign_owners(self) -> dict[str, int]:
        need: dict[str, set[int]] = defaultdict(set)
        for rank, keys in enumerate(self.wanted):
            for param, _, _ in keys:
                need[param].add(rank)
        read: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for rec in self.records:
            read[rec.param][self.reader[rec.file]] += rec.nbytes
        owners = {}
        for param, ranks in need.items():
            most = max(read[param][r] for r in ranks)
            tied = sorted(r for r in ranks if read[param][r] == most)
            # ties (ZeRO: every dp rank read its shard) spread over the tied ranks, the same on every
            # rank: one rank owning every parameter would send each whole tensor dp-1 times alone
            owners[param] = tied[zlib.crc32(param.encode()) % len(tied)]
        return owners

    def destination(self, rec: Record) -> int | None:
        if rec.rng_rank is not None:
            return rec.rng_rank if rec.rng_rank < self.world else None
        return self.owner.get(rec.param)

    def phase_a(self, src: int, dst: int) -> list[Record]:
        """Records `src` sends to `dst`, in order."""
        return [rec for rec in self.records
                if self.reader[rec.file] == src and self.destination(rec) == dst]

    def phase_b(self, src: int, dst: int) -> list[int]:
        """Indices into dst's targets that owner `src` fills, in order."""
        return [i for i, (param, _, _) in enumerate(self.wanted[dst]) if self.owner[param] == src]

    def piece_bytes(self, dst: int, i: int) -> int:
        param, fld, _ = self.wanted[dst][i]
        return piece_numel(self.specs[dst][i]) * _itemsize(self.saved[(param, fld)][0].dtype)


def restore(fs, path: str, manifest: dict, targets: list[Target], comm: Comm,
            memory: InMemory | None = None) -> Restored:
    """Fill `targets` (this rank's tensors) from the checkpoint at `path` (or from the files held
    in `memory`); raises CheckpointError on every rank if any file is corrupt or the checkpoint
    does not fit."""
    wanted = comm.gather([(t.param, t.field, spec_to_json(t.spec)) for t in targets])
    specs = [[spec_from_json(s) for _, _, s in keys] for keys in wanted]
    plan = Plan(manifest, wanted, specs, comm.world, memory.readers if memory else None)

    data, bytes_read, problems = _read_my_files(fs, path, manifest, plan, comm.rank, memory)
    reports = comm.gather(problems)
    failed = [p for ranks in reports for p in ranks]
    if failed:
        raise CheckpointError("; ".join(failed))

    # phase A: stored pieces to owners (and RNG arrays to their ranks)
    sends = [_concat([data[rec.file][rec.offset: rec.offset + rec.nbytes]
                      for rec in plan.phase_a(comm.rank, dst)]) for dst in range(comm.world)]
    sizes = [sum(rec.nbytes for rec in plan.phase_a(src, comm.rank)) for src in range(comm.world)]
    received = comm.exchange(sends, sizes)
    del data, sends
    restored = Restored(bytes_read)
    pieces: dict[tuple[str, str], list[tuple[Record, torch.Tensor]]] = defaultdict(list)
    for src in range(comm.world):
        offset = 0
        for rec in plan.phase_a(src, comm.rank):
            raw = received[src][offset: offset + rec.nbytes]
            offset += rec.nbytes
            tensor = _typed(raw, rec.dtype).view(rec.shape)
            if rec.rng_rank is not None:
                restored.rng[rec.field] = tensor.clone()
            else:
                pieces[(rec.param, rec.field)].append((rec, tensor))
    wholes = {key: _assemble(items) for key, items in pieces.items()}
    del received, pieces

    # phase B: owners cut every rank's pieces
    sends = []
    for dst in range(comm.world):
        parts = []
        for i in plan.phase_b(comm.rank, dst):
            param, fld, _ = plan.wanted[dst][i]
            piece = local_piece(wholes[(param, fld)], plan.specs[dst][i]).contiguous()
            parts.append(piece.reshape(-1).view(torch.uint8))
        sends.append(_concat(parts))
    sizes = [sum(plan.piece_bytes(comm.rank, i) for i in plan.phase_b(src, comm.rank))
             for src in range(comm.world)]
    received = comm.exchange(sends, sizes)
    for src in range(comm.world):
        offset = 0
        for i in plan.phase_b(src, comm.rank):
            nbytes = plan.piece_bytes(comm.rank, i)
            target = targets[i]
            dtype = plan.saved[(target.param, target.field)][0].dtype
            value = _typed(received[src][offset: offset + nbytes], dtype)
            offset += nbytes
            with torch.no_grad():
                target.tensor.copy_(value.view(target.tensor.shape))
    return restored


def _read_my_files(fs, path: str, manifest: dict, plan: Plan, rank: int, memory: InMemory | None = None):
    """Read this rank's files whole (or take them from memory), checking size and sha256;
    returns bytes per file."""
    data: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    bytes_read = 0
    for name in sorted(plan.reader):
        if plan.reader[name] != rank:
            continue
        info = manifest["files"][name]
        if memory is not None:
            if name not in memory.files:
                problems.append(f"{name}: rank {rank} was to hold it in memory and does not")
                continue
            buf = memory.files[name]
            got = len(buf)
        else:
            buf = bytearray(info["size"])
            try:
                with fs.open(confined(fs, path, name), "rb") as f:
                    got = f.readinto(buf)
            except OSError as exc:
                problems.append(f"{name}: cannot be read ({exc})")
                continue
            bytes_read += got
        if got != info["size"]:
            problems.append(f"{name}: {got} bytes, the manifest says {info['size']}")
        elif hashlib.sha256(buf).hexdigest() != info["sha256"]:
            problems.append(f"{name}: sha256 mismatch (the file is corrupt)")
        empty = torch.empty(0, dtype=torch.uint8)
        data[name] = torch.frombuffer(buf, dtype=torch.uint8) if buf else empty
    return data, bytes_read, problems


def _assemble(items: list[tuple[Record, torch.Tensor]]) -> torch.Tensor:
    """The whole parameter from its stored pieces (the plan checked that they cover it)."""
    first = items[0][0]
    whole = torch.zeros(first.spec.global_shape, dtype=first.dtype)
    for rec, data in items:
        _place(whole, rec.spec, data)
    return whole


def _place(whole: torch.Tensor, spec: ShardSpec, data: torch.Tensor) -> None:
    """Inverse of `local_piece`: write a piece's values into the whole parameter."""
    view = tp_slice(whole, spec)
    if spec.flat_range is None:
        view.copy_(data.reshape(view.shape))
        return
    start, end = spec.flat_range
    valid_end = min(end, view.numel())
    if valid_end <= start:
        return
    flat = view.contiguous().reshape(-1)
    flat[start:valid_end] = data.reshape(-1)[: valid_end - start]
    view.copy_(flat.view(view.shape))


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View bytes as `dtype`, copying first when they are not aligned for it."""
    if raw.storage_offset() % _itemsize(dtype):
        raw = raw.clone()
    return raw.view(dtype)


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
