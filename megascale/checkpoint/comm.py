"""The collectives checkpointing needs, over small gloo groups of the rank grid, carrying bytes only.

The checkpoint groups are gloo twins of the job's tp, dp and pp groups
(`ParallelMesh.checkpoint_groups`: their own links, off the training communicators), so a rank
links to tp+dp+pp-3 peers and pays store operations for those, not for a world group. Because the
grid is a product of the three, a world reduction or broadcast is three group collectives, and
any-to-any traffic is routed dimension by dimension (tp, then dp, then pp: at most three hops).

Nothing here sends a Python object: what travels is integer tensors and bytes; structured
metadata is JSON that the receiver parses with a schema (`json_of`), never pickle, so a rank
cannot make another run code by what it sends. With one process every call is local.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, TypeAdapter, ValidationError

from megascale.checkpoint.storage import CheckpointError
from megascale.layout.grid import DIMS, Dim, RankGrid

Model = TypeVar("Model", bound=BaseModel)
_HEADER = 3  # int64s per routed message: source, destination, length
_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}


class Comm:
    def __init__(self, grid: RankGrid, rank: int, groups: dict[Dim, dist.ProcessGroup | None]):
        self.grid, self.rank, self.world = grid, rank, grid.world_size
        self.groups = groups
        self.coords = grid.coords(rank)

    @staticmethod
    def local() -> Comm:
        """One process: every collective is the identity."""
        return Comm(RankGrid(1, 1, 1), 0, {dim: None for dim in DIMS})

    # -------------------------------------------------------------------------- reductions
    def all_reduce(self, values: list[int], op: str = "max") -> list[int]:
        """Element-wise max/min/sum over the world of every rank's integers."""
        tensor = torch.tensor(values, dtype=torch.int64)
        for dim in DIMS:
            if self.groups[dim] is not None:
                dist.all_reduce(tensor, op=_OPS[op], group=self.groups[dim])
        return tensor.tolist()

    def agree(self, problems: list[str]) -> None:
        """Raise CheckpointError on every rank if any rank has a problem (the lowest such rank's
        words, and how many more there are), so that all ranks take the same path."""
        count, first = self.all_reduce([len(problems), -self.rank if problems else -self.world])
        if count == 0:
            return
        shown = json_of(
            list[str], self.broadcast_bytes(json.dumps(problems[:3]).encode(), root=-first), "problem report"
        )
        more = count - len(shown)
        raise CheckpointError("; ".join(shown) + (f" (and {more} more problem(s))" if more > 0 else ""))

    # -------------------------------------------------------------------------- broadcast
    def broadcast_bytes(self, data: bytes, root: int = 0) -> bytes:
        """`root`'s bytes on every rank: along tp from the root's column, then dp, then pp."""
        top = self.grid.coords(root)
        buf = data if self.rank == root else b""
        for dim in DIMS:
            group = self.groups[dim]
            if group is None:
                continue
            src = self.grid.rank_of(**{**self.coords._asdict(), dim: getattr(top, dim)})
            size = torch.tensor([len(buf)], dtype=torch.int64)
            dist.broadcast(size, src, group=group)
            tensor = _as_tensor(buf) if self.rank == src else torch.empty(int(size), dtype=torch.uint8)
            if int(size):
                dist.broadcast(tensor, src, group=group)
            buf = tensor.numpy().tobytes()
        return buf

    def broadcast_json(self, value: Any, kind: Any, what: str, root: int = 0) -> Any:
        """`root`'s JSON-able `value` on every rank, parsed as `kind` (`json_of`)."""
        raw = self.broadcast_bytes(json.dumps(value).encode() if self.rank == root else b"", root)
        return json_of(kind, raw, what)

    # -------------------------------------------------------------------------- any-to-any
    def exchange(self, sends: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """sends[d] (bytes, uint8) goes to rank d; returns {source: the bytes it sent here}.
        Routed over the grid groups; an empty message is not delivered."""
        messages = [(self.rank, dst, data.reshape(-1)) for dst, data in sends.items() if data.numel()]
        for dim in DIMS:
            group = self.groups[dim]
            if group is None:
                continue
            messages = self._hop(dim, group, messages)
        return {src: data for src, _, data in messages}

    def _hop(self, dim: Dim, group: dist.ProcessGroup, messages: list) -> list:
        """Move every message to the member of this rank's `dim` group sharing its destination's
        `dim` coordinate (group index = that coordinate)."""
        size = self.grid.group_size(dim)
        out: list[list] = [[] for _ in range(size)]
        for src, dst, data in messages:
            out[getattr(self.grid.coords(dst), dim)].append((src, dst, data))
        mine = getattr(self.coords, dim)
        kept, out[mine] = out[mine], []
        payloads = [_pack(batch) for batch in out]
        sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64)
        recv_sizes = torch.empty(size, dtype=torch.int64)
        dist.all_to_all_single(recv_sizes, sizes, group=group)
        recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
        dist.all_to_all_single(recv, torch.cat(payloads), recv_sizes.tolist(), sizes.tolist(), group=group)
        for part in recv.split(recv_sizes.tolist()):
            if part.numel():
                kept.extend(_unpack(part))
        return kept

    def gather_bytes(self, data: bytes, root: int = 0) -> dict[int, bytes]:
        """Every rank's bytes on `root` only ({} elsewhere): each rank sends one message."""
        got = self.exchange({root: _as_tensor(data)} if data else {})
        return {src: t.numpy().tobytes() for src, t in got.items()} if self.rank == root else {}

    def scatter_bytes(self, values: dict[int, bytes] | None, root: int = 0) -> bytes:
        """values[r] (given on `root`) on rank r; every rank must be given some bytes."""
        got = self.exchange({dst: _as_tensor(v) for dst, v in values.items()} if self.rank == root else {})
        if root not in got:
            raise CheckpointError(f"rank {self.rank} got nothing from rank {root}")
        return got[root].numpy().tobytes()

    def lowest_holder(self, keys: list[str]) -> list[int]:
        """For each of this rank's keys, the lowest rank that has it too. Keys are hashed to
        coordinating ranks, so no rank sees more than its share of the world's keys."""
        asked: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            asked.setdefault(_home(key, self.world), []).append(i)
        got = self.exchange(
            {dst: _as_tensor(json.dumps([keys[i] for i in idx]).encode()) for dst, idx in asked.items()}
        )
        lists = {src: json_of(list[str], raw.numpy().tobytes(), f"keys from rank {src}") for src, raw in got.items()}
        lowest: dict[str, int] = {}
        for src in sorted(lists):
            for key in lists[src]:
                lowest.setdefault(key, src)
        replies = self.exchange(
            {src: _as_tensor(json.dumps([lowest[k] for k in ks]).encode()) for src, ks in lists.items()}
        )
        out = [self.rank] * len(keys)
        for home, idx in asked.items():
            answer = json_of(list[int], replies[home].numpy().tobytes(), f"holders from rank {home}")
            for i, holder in zip(idx, answer, strict=True):
                out[i] = holder
        return out


def json_of(kind: Any, raw: bytes | str, what: str) -> Any:
    """`raw` parsed as `kind` (a pydantic model or type), strictly; a CheckpointError naming
    `what` if it does not fit. The one way checkpoint metadata from a peer is read."""
    try:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind.model_validate_json(raw, strict=True)
        return TypeAdapter(kind).validate_json(raw, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CheckpointError(
            f"{what} does not fit its schema ({'.'.join(map(str, first['loc']))}: {first['msg']})"
        ) from None


def _home(key: str, world: int) -> int:
    return zlib.crc32(key.encode()) % world


def _as_tensor(data: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _pack(batch: list) -> torch.Tensor:
    if not batch:
        return torch.empty(0, dtype=torch.uint8)
    header = torch.tensor(
        [len(batch)] + [v for src, dst, data in batch for v in (src, dst, data.numel())], dtype=torch.int64
    )
    return torch.cat([header.view(torch.uint8)] + [data for _, _, data in batch])


def _unpack(part: torch.Tensor) -> list:
    count = int(part[:8].clone().view(torch.int64))
    header = part[8 : 8 + 8 * _HEADER * count].clone().view(torch.int64).view(count, _HEADER).tolist()
    offset, out = 8 + 8 * _HEADER * count, []
    for src, dst, length in header:
        out.append((src, dst, part[offset : offset + length]))
        offset += length
    if offset != part.numel():
        raise CheckpointError(f"a routed checkpoint message is {part.numel()} bytes, its header says {offset}")
    return out
