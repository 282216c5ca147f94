"""Rank layout of a 3D-parallel job: pure arithmetic, no processes.

Ranks are laid out as `arange(world).view(pp, dp, tp)`: tp innermost (neighbouring ranks, the
fastest links inside a node), then dp, then pp. MegaScale places DP groups closer than PP groups
because ZeRO's all-gather/reduce-scatter traffic is heavier than pipeline point-to-point traffic.
Every process group of the job is derived from this one grid, so the mesh, the data loader, the
checkpointer and the diagnostics agree on who is whose neighbour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

Dim = Literal["tp", "dp", "pp", "mp", "dp_tp"]
DIMS: tuple[Dim, ...] = ("tp", "dp", "pp", "mp", "dp_tp")

# Which grid axes vary inside a group of each dimension; the others are fixed.
_VARYING: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "mp": ("pp", "tp"),  # model-parallel: one full model replica (same dp index)
    "dp_tp": ("dp", "tp"),  # one pipeline stage (same pp index)
}


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class RankGrid:
    pp: int
    dp: int
    tp: int

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RankGrid.{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coords(pp=pp, dp=dp, tp=tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} out of range [0, {size})")
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, dim: Dim) -> list[list[int]]:
        """Every group of `dim`, each sorted, ordered by the smallest rank it holds."""
        varying = self._varying(dim)
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)._asdict()
            key = tuple(c[a] for a in ("pp", "dp", "tp") if a not in varying)
            by_key.setdefault(key, []).append(rank)
        groups = sorted(by_key.values(), key=lambda g: g[0])
        expected = 1
        for axis in varying:
            expected *= sizes[axis]
        assert all(len(g) == expected for g in groups)
        return groups

    def group_of(self, rank: int, dim: Dim) -> list[int]:
        """The ranks of `rank`'s group in `dim`, computed without enumerating the world."""
        varying = self._varying(dim)
        c = self.coords(rank)
        ranges = {
            axis: range(getattr(self, axis)) if axis in varying else (getattr(c, axis),)
            for axis in ("pp", "dp", "tp")
        }
        return sorted(
            self.rank_of(p, d, t) for p in ranges["pp"] for d in ranges["dp"] for t in ranges["tp"]
        )

    def group_size(self, dim: Dim) -> int:
        size = 1
        for axis in self._varying(dim):
            size *= getattr(self, axis)
        return size

    def _varying(self, dim: str) -> tuple[str, ...]:
        if dim not in _VARYING:
            raise ValueError(f"unknown mesh dimension {dim!r}; choose one of {list(DIMS)}")
        return _VARYING[dim]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
