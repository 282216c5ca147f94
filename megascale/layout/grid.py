"""Rank layout of a 3D-parallel job: pure arithmetic, no processes.

Ranks are laid out as `arange(world).view(pp, dp, cp, tp)`: tp innermost (neighbouring ranks, the
fastest links inside a node), then cp (context parallelism: its halo/ring point-to-point traffic
runs every layer, so it sits next to tp, as in Megatron's tp-cp-dp-pp order), then dp, then pp.
MegaScale places DP groups closer than PP groups because ZeRO's all-gather/reduce-scatter traffic
is heavier than pipeline point-to-point traffic.
Every process group of the job is derived from this one grid, so the mesh, the data loader, the
checkpointer and the diagnostics agree on who is whose neighbour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

Dim = Literal["tp", "cp", "dp", "pp"]
DIMS: tuple[Dim, ...] = ("tp", "cp", "dp", "pp")


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int
    cp: int = 0


class HasDegrees(Protocol):
    """Anything that states the degrees: `ParallelConfig`, the planner's `Layout` (cp: 1 if absent)."""

    @property
    def pp(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def tp(self) -> int: ...


@dataclass(frozen=True)
class RankGrid:
    """The one rank order of the job, and the one place its world size is computed."""

    pp: int
    dp: int
    tp: int
    cp: int = 1
    ep: int = 1  # expert parallelism, carved from dp (not a dimension of its own)

    @classmethod
    def of(cls, degrees: HasDegrees) -> RankGrid:
        return cls(
            pp=degrees.pp, dp=degrees.dp, tp=degrees.tp, cp=getattr(degrees, "cp", 1), ep=getattr(degrees, "ep", 1)
        )

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RankGrid.{name} must be an integer >= 1, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(f"RankGrid.ep={self.ep} must divide dp={self.dp}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return Coords(pp=pp, dp=dp, tp=tp, cp=cp)

    def named_coords(self, rank: int) -> dict[str, int]:
        """pp, dp, tp of `rank` (and cp in a context-parallel job), for logs, timers and reports."""
        coords = self.coords(rank)._asdict()
        if self.cp == 1:
            del coords["cp"]
        return coords

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp), ("cp", cp, self.cp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} out of range [0, {size})")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, dim: Dim) -> list[list[int]]:
        """Every group of `dim`, each sorted, ordered by the smallest rank it holds."""
        firsts = [r for r in range(self.world_size) if getattr(self.coords(r), self._axis(dim)) == 0]
        return [self.group_of(r, dim) for r in firsts]

    def group_of(self, rank: int, dim: Dim) -> list[int]:
        """The ranks of `rank`'s group in `dim`: those differing from it only in that coordinate."""
        c = self.coords(rank)._asdict()
        axis = self._axis(dim)
        return [self.rank_of(**{**c, axis: i}) for i in range(getattr(self, axis))]

    def expert_groups_of(self, rank: int) -> tuple[list[int], list[int]]:
        """(ep group, expert-data group) of `rank`. The ep group is `ep` consecutive dp ranks (the
        closest ones, as the all-to-all is the heaviest traffic); the expert-data group holds the
        ranks with the same experts (same place in their ep groups), over which expert gradients
        are summed."""
        c = self.coords(rank)
        block, place = divmod(c.dp, self.ep)
        ep = [self.rank_of(c.pp, block * self.ep + i, c.tp, c.cp) for i in range(self.ep)]
        data = [self.rank_of(c.pp, b * self.ep + place, c.tp, c.cp) for b in range(self.dp // self.ep)]
        return ep, data

    def group_size(self, dim: Dim) -> int:
        return getattr(self, self._axis(dim))

    @staticmethod
    def _axis(dim: str) -> str:
        if dim not in DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; choose one of {list(DIMS)}")
        return dim

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
