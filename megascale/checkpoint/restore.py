"""Recovery: every stored byte is read once, whatever the layout, then sent where it is needed.

`load` is the collective: rank 0 (which holds the validated manifest) broadcasts an `Outline`,
every rank builds its targets from it and sends them to rank 0, rank 0 makes the `Plan`
(`checkpoint.plan`) and sends each rank its `Part`; then
- each rank reads its files whole, checking size and sha256 in the same pass;
- phase A: readers send stored pieces to the ranks that take them as they are (an unchanged
  layout), to the owners of fields that must be put together (a changed layout), and RNG arrays
  to their ranks; owners put the pieces together into whole tensors;
- phase B: owners cut each rank's piece (`local_piece`, any tp/ZeRO layout) and send it.
Every message is bytes on the checkpoint groups (`checkpoint.comm`); the metadata is JSON checked
against the plan's schemas where it is received. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megascale.checkpoint.comm import Comm, json_of
from megascale.checkpoint.manifest import confined
from megascale.checkpoint.plan import Outline, Part, Plan, Wanted, outline
from megascale.checkpoint.state import Target, torch_dtype
from megascale.checkpoint.storage import CheckpointError, paused_gc
from megascale.layout.shard import ShardSpec, local_piece, tp_slice


@dataclass(frozen=True)
class InMemory:
    """Data files already in this process's memory (peer copies, `replica.py`): `files` are the
    ones this rank holds; `readers` (needed on rank 0 only) says which rank holds each file of
    the manifest. They are checked against the manifest's sizes and sha256 exactly as files read
    from storage."""

    files: dict[str, memoryview]
    readers: dict[str, int] | None = None


@dataclass
class Restored:
    bytes_read: int
    rng: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Loaded:
    outline: Outline
    part: Part
    targets: list[Target]
    restored: Restored


def load(
    fs,
    path: str,
    manifest: dict | None,
    comm: Comm,
    make_targets: Callable[[dict[str, set[str]]], list[Target]],
    memory: InMemory | None = None,
) -> Loaded:
    """Fill this rank's targets from the checkpoint at `path` (or from the files in `memory`).
    Collective; `manifest` is the validated manifest on rank 0 (None elsewhere). Raises
    CheckpointError on every rank if the checkpoint does not fit or any file is corrupt."""
    head = json.dumps(outline(manifest)).encode() if comm.rank == 0 else b""
    shape = json_of(Outline, comm.broadcast_bytes(head), "checkpoint outline")
    targets = make_targets({name: set(fields) for name, fields in shape.fields.items()})
    wanted = [
        {
            "param": t.param,
            "field": t.field,
            "spec": t.spec.to_json(),
            "dtype": str(t.tensor.dtype).removeprefix("torch."),
        }
        for t in targets
    ]
    got = comm.gather_bytes(json.dumps(wanted).encode())
    parts, error = None, None
    if comm.rank == 0:
        try:
            lists = [
                [w.model_dump() for w in json_of(list[Wanted], got[r], f"targets of rank {r}")]
                for r in range(comm.world)
            ]
            with paused_gc():
                parts = Plan(manifest, lists, memory.readers if memory else None).parts()
        except CheckpointError as exc:
            error = str(exc)
    error = comm.broadcast_json(error, str | None, "restore plan status")
    if error is not None:
        raise CheckpointError(error)
    mine = comm.scatter_bytes({r: json.dumps(p).encode() for r, p in parts.items()} if parts else None)
    part = json_of(Part, mine, f"restore plan of rank {comm.rank}")
    return Loaded(shape, part, targets, restore(fs, path, part, targets, comm, memory))


def restore(fs, path: str, part: Part, targets: list[Target], comm: Comm, memory: InMemory | None) -> Restored:
    """Execute this rank's part of the plan."""
    data, bytes_read, problems = _read_my_files(fs, path, part, comm.rank, memory)
    comm.agree(problems)

    # phase A: stored pieces to the ranks that take them whole, to owners, RNG arrays to their ranks
    outgoing: dict[int, list[torch.Tensor]] = defaultdict(list)
    for send in part.sends:
        outgoing[send.dst].append(data[send.file][send.offset : send.offset + send.nbytes])
    received = comm.exchange({dst: _concat(parts) for dst, parts in outgoing.items()})
    del data, outgoing
    restored = Restored(bytes_read)
    pieces: dict[tuple[str, str], list[tuple[ShardSpec, torch.Tensor]]] = defaultdict(list)
    reader = _Reader(received)
    for inc in part.incoming:
        raw = reader.take(inc.src, inc.nbytes)
        if raw is None:
            continue
        tensor = _typed(raw, torch_dtype(inc.dtype)).view(inc.shape)
        if inc.kind == "target":
            _fill(targets[inc.index], tensor, reader.problems)
        elif inc.kind == "rng":
            restored.rng[inc.field] = tensor.clone()
        else:
            pieces[(inc.param, inc.field)].append((ShardSpec.from_json(inc.spec), tensor))
    reader.finish()
    comm.agree(reader.problems)
    wholes = {
        (o.param, o.field): _assemble(o.global_shape, torch_dtype(o.dtype), pieces[(o.param, o.field)])
        for o in part.owned
    }
    del received, pieces

    # phase B: owners cut every rank's pieces
    outgoing = defaultdict(list)
    for cut in part.cuts:
        piece = local_piece(wholes[(cut.param, cut.field)], ShardSpec.from_json(cut.spec)).contiguous()
        outgoing[cut.dst].append(piece.reshape(-1).view(torch.uint8))
    reader = _Reader(comm.exchange({dst: _concat(parts) for dst, parts in outgoing.items()}))
    del wholes, outgoing
    for fill in part.fills:
        raw = reader.take(fill.src, fill.nbytes)
        if raw is not None:
            target = targets[fill.index]
            _fill(target, _typed(raw, target.tensor.dtype), reader.problems)
    reader.finish()
    comm.agree(reader.problems)
    return restored


class _Reader:
    """Walks the bytes each source sent, in plan order; a source that sent more or less than the
    plan says is a problem (reported, so that every rank can fail together)."""

    def __init__(self, received: dict[int, torch.Tensor]):
        self.received, self.offsets, self.problems = received, defaultdict(int), []

    def take(self, src: int, nbytes: int) -> torch.Tensor | None:
        buf, start = self.received.get(src), self.offsets[src]
        if buf is None or start + nbytes > buf.numel():
            self.problems.append(f"rank {src} sent {0 if buf is None else buf.numel()} bytes, fewer than planned")
            return None
        self.offsets[src] = start + nbytes
        return buf[start : start + nbytes]

    def finish(self) -> None:
        for src, buf in self.received.items():
            if self.offsets[src] != buf.numel():
                self.problems.append(f"rank {src} sent {buf.numel()} bytes, the plan says {self.offsets[src]}")


def _fill(target: Target, value: torch.Tensor, problems: list[str]) -> None:
    if value.dtype != target.tensor.dtype or value.numel() != target.tensor.numel():
        problems.append(
            f"{target.param} ({target.field}): {value.numel()} {value.dtype} values for a "
            f"{target.tensor.dtype} tensor of {target.tensor.numel()}"
        )
        return
    with torch.no_grad():
        target.tensor.copy_(value.view(target.tensor.shape))


def _read_my_files(fs, path: str, part: Part, rank: int, memory: InMemory | None = None):
    """Read this rank's files whole (or take them from memory), checking size and sha256;
    returns bytes per file."""
    data: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    bytes_read = 0
    for name in sorted(part.files):
        info = part.files[name].model_dump()
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


def _assemble(shape: list[int], dtype: torch.dtype, items: list[tuple[ShardSpec, torch.Tensor]]) -> torch.Tensor:
    """The whole parameter from its stored pieces (the plan checked that they cover it)."""
    whole = torch.zeros(shape, dtype=dtype)
    for spec, data in items:
        _place(whole, spec, data)
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
