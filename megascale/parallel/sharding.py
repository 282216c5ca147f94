"""What part of a whole parameter a local tensor holds.

Every layout is described the same way: tensor parallelism cuts a parameter into `tp` equal
contiguous slices along one dimension; ZeRO then gives each dp rank a contiguous range of the
flattened tp slice. A local tensor carries its `ShardSpec` in `tensor._shard`, so that
checkpoints can reshard between layouts and norms can be made whole again, without knowing
which parallel code produced the piece.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

SHARD_ATTR = "_shard"


@dataclass(frozen=True)
class ShardSpec:
    global_shape: tuple[int, ...]
    tp_dim: int | None = None  # dimension split over tp; None = replicated over tp
    tp_rank: int = 0
    tp_size: int = 1
    flat_range: tuple[int, int] | None = None  # ZeRO: [start, end) of the flattened tp slice

    @property
    def tp_shape(self) -> tuple[int, ...]:
        """Shape of this rank's tensor-parallel slice (before ZeRO flattening)."""
        if self.tp_dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.tp_dim] //= self.tp_size
        return tuple(shape)

    def with_flat_range(self, start: int, end: int) -> ShardSpec:
        return replace(self, flat_range=(start, end))


def shard_spec(tensor: torch.Tensor) -> ShardSpec:
    """The tensor's spec; an unannotated tensor is the whole parameter."""
    return getattr(tensor, SHARD_ATTR, None) or ShardSpec(tuple(tensor.shape))


def set_shard_spec(tensor: torch.Tensor, spec: ShardSpec) -> None:
    setattr(tensor, SHARD_ATTR, spec)


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
    out = torch.zeros(end - start, dtype=whole.dtype, device=whole.device)  # padding stays zero
    if valid_end > start:
        out[: valid_end - start] = flat[start:valid_end]
    return out
