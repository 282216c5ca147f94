"""What part of a whole parameter a local tensor holds, and how its pieces add up.

Every layout is described the same way: tensor parallelism cuts a parameter into `tp` equal
contiguous slices along one dimension; ZeRO then gives each dp rank a contiguous range of the
flattened tp slice. A local tensor carries one `ShardSpec` (its only piece of layout metadata),
so that checkpoints reshard between layouts, norms are made whole again over the right groups,
weight decay knows a flat ZeRO shard was a matrix, and sequence-parallel gradients are summed
over tp -- without knowing which parallel code produced the piece.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no torch at import: the manifest checks (and the stage-2 writer) use ShardSpec
    import torch
    import torch.distributed as dist

_ATTR = "_shard"


@dataclass(frozen=True)
class ShardSpec:
    global_shape: tuple[int, ...]
    tp_dim: int | None = None  # dimension split over tp; None = replicated over tp
    tp_rank: int = 0
    tp_size: int = 1
    flat_range: tuple[int, int] | None = None  # ZeRO: [start, end) of the flattened tp slice
    # Replicated over tp but used on a sequence slice (sequence parallelism): each tp rank's
    # gradient is partial and must be summed over tp.
    sp_partial: bool = False
    # Process groups over which the pieces' sums of squares add up to the whole tensor's (tp for
    # a sliced weight, dp for a ZeRO shard). Runtime only: never saved, never compared.
    groups: tuple[dist.ProcessGroup, ...] = field(default=(), compare=False, repr=False)
    # Groups whose ranks hold *different* whole tensors of this kind (expert parallelism: each ep
    # rank its own experts), whose totals add up in a model-wide norm. Runtime only, as `groups`.
    disjoint: tuple[dist.ProcessGroup, ...] = field(default=(), compare=False, repr=False)

    @property
    def tp_shape(self) -> tuple[int, ...]:
        """Shape of this rank's tensor-parallel slice (before ZeRO flattening)."""
        if self.tp_dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.tp_dim] //= self.tp_size
        return tuple(shape)

    @property
    def matrix(self) -> bool:
        """The whole parameter has two or more dimensions (a flat ZeRO shard of a matrix too)."""
        return len(self.global_shape) >= 2

    @property
    def numel(self) -> int:
        """Elements a rank holding this piece stores (ZeRO shards include their padding)."""
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return math.prod(self.tp_shape)

    @property
    def valid_numel(self) -> int:
        """Elements of the whole parameter this piece carries (padding excluded)."""
        whole = math.prod(self.tp_shape)
        if self.flat_range is None:
            return whole
        start, end = self.flat_range
        return max(0, min(end, whole) - start)

    def to_json(self) -> dict[str, Any]:
        """The stored form (checkpoint records, restore plans): the layout, never the groups;
        `sp_partial` is how this run uses the piece, not what it holds, so it is not stored."""
        return {
            "global_shape": list(self.global_shape),
            "tp_dim": self.tp_dim,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "flat_range": list(self.flat_range) if self.flat_range else None,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> ShardSpec:
        """Inverse of `to_json` (its input is schema-checked first: `checkpoint.manifest.Spec`)."""
        flat = data["flat_range"]
        return ShardSpec(
            tuple(data["global_shape"]),
            data["tp_dim"],
            data["tp_rank"],
            data["tp_size"],
            tuple(flat) if flat is not None else None,
        )

    def split_over(self, *groups: dist.ProcessGroup | None) -> ShardSpec:
        """The same piece, now also one of several summed over `groups` (None entries ignored)."""
        return replace(self, groups=self.groups + tuple(g for g in groups if g is not None))

    def held_apart_over(self, group: dist.ProcessGroup | None) -> ShardSpec:
        """The same piece, on a rank of `group` whose other ranks hold other tensors (experts)."""
        return self if group is None else replace(self, disjoint=self.disjoint + (group,))

    def with_flat_range(self, start: int, end: int) -> ShardSpec:
        return replace(self, flat_range=(start, end))

    def with_sp_partial(self) -> ShardSpec:
        return replace(self, sp_partial=True)

    def __deepcopy__(self, memo: dict) -> ShardSpec:
        return self  # immutable, and its process groups must stay the same objects

    def __reduce__(self):
        """Pickled (sent to another process) without its process groups, which belong to this one."""
        return _unpickled, (self.to_json(), self.sp_partial)


def _unpickled(data: dict[str, Any], sp_partial: bool) -> ShardSpec:
    spec = ShardSpec.from_json(data)
    return spec.with_sp_partial() if sp_partial else spec


def shard_spec(tensor: torch.Tensor) -> ShardSpec:
    """The tensor's spec; an unannotated tensor is the whole parameter."""
    return getattr(tensor, _ATTR, None) or ShardSpec(tuple(tensor.shape))


def set_shard_spec(tensor: torch.Tensor, spec: ShardSpec) -> None:
    setattr(tensor, _ATTR, spec)


def tp_slice(whole: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's tensor-parallel slice of the whole parameter (a view)."""
    if spec.tp_dim is None:
        return whole
    size = whole.shape[spec.tp_dim] // spec.tp_size
    return whole.narrow(spec.tp_dim, spec.tp_rank * size, size)


def local_piece(whole: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The exact values a rank with `spec` holds, cut from the whole parameter."""
    piece = tp_slice(whole, spec)
    if spec.flat_range is None:
        return piece
    start, end = spec.flat_range
    flat = piece.reshape(-1)
    valid_end = min(end, flat.numel())
    out = whole.new_zeros(end - start)  # padding stays zero
    if valid_end > start:
        out[: valid_end - start] = flat[start:valid_end]
    return out
