"""The job's process groups, built once from the rank grid, queried by every component.

Start-up follows MegaScale's fix for slow communicator initialisation: no global barrier after
each group. Each rank creates only the groups it belongs to (`use_local_synchronization=True`,
so the group's name is a hash of its ranks and non-members skip the call), always in the same
global order (dimension by dimension), which keeps the overlapping creations deadlock-free.
A rank's store traffic then depends only on the groups it is in (their number and, for gloo's
full-mesh address exchange, their sizes), not on the world size.

NCCL is used lazily (no `device_id` binding): a bound default group would make subgroup
creation an `ncclCommSplit`, which every rank of the world must join, defeating local creation.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megascale.config.fields import ConfigError
from megascale.config.schema import ParallelConfig
from megascale.layout.grid import DIMS, Coords, Dim, RankGrid
from megascale.layout.launch import LaunchEnv
from megascale.parallel.store import CountingStore, StartupStats, StoreAddress, create_store

log = logging.getLogger(__name__)

ProcessGroup = dist.ProcessGroup


class ParallelMesh:
    """Coordinates and process groups of one rank in a (pp, dp, cp, tp) job."""

    def __init__(
        self,
        grid: RankGrid,
        rank: int,
        device: torch.device,
        backend: str,
        groups: dict[str, ProcessGroup | None],
        startup: StartupStats,
        timeout: timedelta,
        store: dist.Store | None,
        launch: LaunchEnv,
    ) -> None:
        self.grid = grid
        self.launch = launch  # the environment the launcher gave this process, read once
        self.rank = rank
        self.world_size = grid.world_size
        self.coords: Coords = grid.coords(rank)
        self.device = device
        self.backend = backend
        self.startup = startup
        self._groups = groups
        self._timeout = timeout
        # The default group holds the store only on the C++ side; a Python store subclass must
        # also stay referenced here or its overrides vanish (pybind11 trampoline).
        self.store = store
        self._side_groups: dict[str, dict[Dim, ProcessGroup | None]] = {}

    # coordinates -------------------------------------------------------------------------------
    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def cp_size(self) -> int:
        return self.grid.cp

    @property
    def pp_size(self) -> int:
        return self.grid.pp

    @property
    def dp_size(self) -> int:
        return self.grid.dp

    @property
    def tp_size(self) -> int:
        return self.grid.tp

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.grid.pp - 1

    # groups ------------------------------------------------------------------------------------
    @property
    def tp_group(self) -> ProcessGroup | None:
        return self._groups["tp"]

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self._groups["dp"]

    @property
    def pp_group(self) -> ProcessGroup | None:
        return self._groups["pp"]

    # expert parallelism (carved from dp; None when ep = 1 or the group would be one rank)
    @property
    def ep_size(self) -> int:
        return self.grid.ep

    @property
    def ep_rank(self) -> int:
        return self.coords.dp % self.grid.ep

    @property
    def ep_group(self) -> ProcessGroup | None:
        return self._groups.get("ep")

    @property
    def expert_dp_size(self) -> int:
        """Ranks holding the same experts (their gradients are summed over them)."""
        return self.grid.dp // self.grid.ep

    @property
    def expert_dp_rank(self) -> int:
        return self.coords.dp // self.grid.ep

    @property
    def expert_dp_group(self) -> ProcessGroup | None:
        return self._groups.get("edp")

    @property
    def cp_group(self) -> ProcessGroup | None:
        """Context parallelism's ranks: one sequence, split along it (`parallel/context.py`)."""
        return self._groups["cp"]

    def dim_of(self, group: ProcessGroup | None) -> str | None:
        """The mesh dimension `group` spans (tp, dp, pp, cp, ep, edp), or None for another group."""
        return next((dim for dim, g in self._groups.items() if g is not None and g is group), None)

    @property
    def checkpoint_groups(self) -> dict[Dim, ProcessGroup | None]:
        """Gloo twins of the tp, dp and pp groups for checkpoint traffic, kept off the training
        links (`checkpoint.comm` routes world-wide collectives over them). A rank pays store
        operations and sockets for tp+dp+pp peers, not for the world. Created on first access,
        which is collective (every rank makes it, in the same order relative to other groups)."""
        return self._grid_twins("checkpoint")

    @property
    def replica_groups(self) -> dict[Dim, ProcessGroup | None]:
        """Another set of twins, for the peer copies a background thread sends (a group's
        operations must come in one order on every rank, so they cannot share the checkpoint's).
        Its first access is collective, as the checkpoint groups'. (Pairs {r, r+offset} would be
        smaller, but torch names a locally created group by its ranks and the number of groups
        the creating rank already has, so a ring of pairs gets different names on its two ends.)"""
        return self._grid_twins("replica")

    def _grid_twins(self, name: str) -> dict[Dim, ProcessGroup | None]:
        if name not in self._side_groups:
            twins: dict[Dim, ProcessGroup | None] = {}
            for dim in DIMS:  # one global order; every rank has as many groups before each
                members = self.grid.group_of(self.rank, dim)
                twins[dim] = (
                    None
                    if len(members) == 1
                    else dist.new_group(
                        members,
                        timeout=self._timeout,
                        backend="gloo",
                        use_local_synchronization=True,
                        group_desc=f"{name}-{dim}",
                    )
                )
            self._side_groups[name] = twins
        return self._side_groups[name]

    def destroy(self) -> None:
        """Tear down every group this mesh created (and the default group if it made it)."""
        if self.store is not None and dist.is_initialized():
            dist.destroy_process_group()
        close = getattr(getattr(self.store, "inner", None), "close", None)
        if close is not None:
            close()  # the Redis client's connections
        self._groups = {dim: None for dim in DIMS}
        self._side_groups = {}

    def abort(self) -> None:
        """Drop every group without waiting for operations in flight (a peer failed). NCCL's
        communicators are aborted; gloo's fail once their connections are shut down."""
        if self.backend == "nccl" and self.store is not None and dist.is_initialized():
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        self.destroy()
        self.store = None  # the rendezvous store (rank 0 serves it) closes with its last reference

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"ParallelMesh(rank={self.rank}/{self.world_size}, pp={c.pp}/{self.pp_size}, "
            f"dp={c.dp}/{self.dp_size}, cp={c.cp}/{self.cp_size}, tp={c.tp}/{self.tp_size}, "
            f"{self.backend}, {self.device})"
        )


def init_mesh(cfg: ParallelConfig, device: str = "auto") -> ParallelMesh:
    """Join the job (torchrun-style environment, read once: `mesh.launch`) and create this
    rank's process groups. `device` is `train.device`: auto, cpu or cuda."""
    start = time.perf_counter()
    grid = RankGrid.of(cfg)
    launch = LaunchEnv.from_env()
    env_world, rank = launch.world_size, launch.rank
    if env_world != grid.world_size:
        raise ConfigError(
            f"parallel.dp*cp*tp*pp = {cfg.dp}*{cfg.cp}*{cfg.tp}*{cfg.pp} = {grid.world_size} but "
            f"WORLD_SIZE={env_world}; launch {grid.world_size} processes or change the layout"
        )
    dev = launch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = _choose_backend(cfg.backend, dev)
    timeout = timedelta(seconds=cfg.collective_timeout_s)

    if grid.world_size == 1:
        stats = StartupStats(store="none", time_s=time.perf_counter() - start)
        groups: dict[str, ProcessGroup | None] = {dim: None for dim in DIMS}
        return ParallelMesh(grid, 0, dev, backend, groups, stats, timeout, None, launch)

    counter = join_world(cfg, rank, env_world, backend, timeout)
    init_ops = counter.total_ops
    groups, created = create_groups(grid, rank, timeout)
    if grid.ep > 1:  # after the dimensions' groups, in the same order on every rank
        for key, members in zip(("ep", "edp"), grid.expert_groups_of(rank), strict=True):
            groups[key] = (
                None
                if len(members) == 1
                else dist.new_group(members, timeout=timeout, use_local_synchronization=True, group_desc=key)
            )
            created += len(members) > 1
    stats = StartupStats(
        store=cfg.store,
        time_s=time.perf_counter() - start,
        store_ops=dict(counter.ops),
        init_ops=init_ops,
        group_ops=counter.total_ops - init_ops,
        barriers=counter.barriers,
        groups_created=created,
    )
    log.info("rank %d %s", rank, stats.summary())
    return ParallelMesh(grid, rank, dev, backend, groups, stats, timeout, counter, launch)


def join_world(cfg: ParallelConfig, rank: int, world_size: int, backend: str, timeout: timedelta) -> CountingStore:
    """Create the default group on the configured store; the counter sees all later traffic."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised; init_mesh creates the default group "
            "itself (call mesh.destroy() before creating another mesh)"
        )
    address = StoreAddress.from_env(need_master=cfg.store == "tcp")
    counter = CountingStore(create_store(cfg, rank, world_size, address))
    dist.init_process_group(backend=backend, store=counter, rank=rank, world_size=world_size, timeout=timeout)
    return counter


def create_groups(
    grid: RankGrid, rank: int, timeout: timedelta, dims: tuple[Dim, ...] = DIMS
) -> tuple[dict[str, ProcessGroup | None], int]:
    """This rank's group of every dimension; returns the groups and how many were created.

    Size-1 groups are None and a group spanning the world is the default group. Only tp, cp, dp
    and pp groups exist: nothing reads any other, so none is created."""
    groups: dict[str, ProcessGroup | None] = {}
    created = 0
    for dim in dims:
        members = grid.group_of(rank, dim)
        if len(members) == 1:
            groups[dim] = None
        elif len(members) == grid.world_size:
            groups[dim] = dist.group.WORLD
        else:
            groups[dim] = dist.new_group(members, timeout=timeout, use_local_synchronization=True, group_desc=dim)
            created += 1
    return groups, created


def _choose_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend='nccl' needs a CUDA device; use 'gloo' or 'auto'")
    return backend
