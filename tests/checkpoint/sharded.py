"""A sharded training state cut by hand, for resharding and read-once tests.

Each rank holds exactly what the parallel code gives it: tensor-parallel slices (with their
`ShardSpec`), ZeRO flat ranges of them (padded), a pipeline stage's subset of parameters, and
AdamW state shaped like each piece. Whole tensors are known, so every loaded piece can be
checked against `local_piece(whole, spec)`. The checkpoint code sees a `CheckpointState` only.
"""

from __future__ import annotations

import contextlib
import math
import pickle
from pathlib import Path

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from torch import nn

from megascale.checkpoint.stateful import CheckpointState, RNGState, TrainState
from megascale.config.operations import CheckpointConfig
from megascale.config.schema import JobConfig, ParallelConfig
from megascale.layout.shard import ShardSpec, local_piece, set_shard_spec, shard_spec

# name -> (shape, tp dimension or None); "bias" has 9 elements so ZeRO pads it
PARAMS = {
    "blocks.0.col.weight": ((8, 6), 0),
    "blocks.0.row.weight": ((6, 8), 1),
    "blocks.0.norm.weight": ((6,), None),
    "blocks.1.col.weight": ((8, 6), 0),
    "blocks.1.col.bias": ((9,), None),
    "head.weight": ((4, 6), 1),
}
FIELDS = ("value", "exp_avg", "exp_avg_sq")


def wholes(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {f: {n: torch.randn(shape, generator=g) for n, (shape, _) in PARAMS.items()} for f in FIELDS}


def stage_params(pp_rank: int, pp: int) -> list[str]:
    names = list(PARAMS)
    per = len(names) // pp
    return names[pp_rank * per : (pp_rank + 1) * per]


class Runner:
    def __init__(self, params: dict[str, nn.Parameter], shards: dict[str, torch.Tensor] | None):
        self.params, self.shards = params, shards

    def named_parameters(self):
        return iter(self.params.items())

    def optimizer_tensors(self):
        return list((self.shards or self.params).items())


class Loader:
    def __init__(self):
        self.state = {"step": 0, "consumed": "0", "fingerprint": "test"}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def spec_for(mesh, name: str, zero: bool) -> tuple[ShardSpec, ShardSpec]:
    """(spec of the tp slice = the parameter, spec of the optimizer tensor)."""
    shape, tp_dim = PARAMS[name]
    spec = ShardSpec(shape) if tp_dim is None else ShardSpec(shape, tp_dim, mesh.tp_rank, mesh.tp_size)
    if not zero:
        return spec, spec
    per = -(-math.prod(spec.tp_shape) // mesh.dp_size)
    return spec, spec.with_flat_range(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)


def build_state(mesh, zero: bool, seed: int | None, root: str, step: int = 0) -> tuple[JobConfig, CheckpointState]:
    """The job config and the state to save or load into; `seed=None` leaves parameters zero
    and the optimizer empty."""
    values = wholes(seed) if seed is not None else None
    params, shards = {}, {}
    for name in stage_params(mesh.pp_rank, mesh.pp_size):
        pspec, ospec = spec_for(mesh, name, zero)
        zeros = torch.zeros(PARAMS[name][0])
        params[name] = nn.Parameter(local_piece(values["value"][name] if values else zeros, pspec))
        set_shard_spec(params[name], pspec)
        if zero:
            shards[name] = local_piece(values["value"][name] if values else zeros, ospec)
            set_shard_spec(shards[name], ospec)
    runner = Runner(params, shards if zero else None)
    optimizer = torch.optim.AdamW([t for _, t in runner.optimizer_tensors()], lr=1e-3)
    if values is not None:
        for name, tensor in runner.optimizer_tensors():
            spec = shard_spec(tensor)
            optimizer.state[tensor] = {
                "step": torch.tensor(float(step)),
                "exp_avg": local_piece(values["exp_avg"][name], spec),
                "exp_avg_sq": local_piece(values["exp_avg_sq"][name], spec),
            }
    cfg = JobConfig(
        parallel=ParallelConfig(pp=mesh.pp_size, dp=mesh.dp_size, tp=mesh.tp_size),
        checkpoint=CheckpointConfig(dir=root, every=0),
    )
    return cfg, CheckpointState(
        model=runner, optimizer=optimizer, loader=Loader(), train=TrainState(step), rng=RNGState(torch.device("cpu"))
    )


def check_state(state: CheckpointState, seed: int, step: int) -> list[str]:
    """Every local tensor and optimizer state equals its cut of the whole; returns mismatches."""
    values = wholes(seed)
    bad = []
    for name, param in state.model.named_parameters():
        if not torch.equal(param.data, local_piece(values["value"][name], shard_spec(param))):
            bad.append(f"param {name}")
    for name, tensor in state.model.optimizer_tensors():
        spec = shard_spec(tensor)
        if not torch.equal(tensor.data, local_piece(values["value"][name], spec)):
            bad.append(f"optimizer tensor {name}")
        moments = state.optimizer.state[tensor]
        for field in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(moments[field], local_piece(values[field][name], spec)):
                bad.append(f"{field} {name}")
        if float(moments["step"]) != step:
            bad.append(f"step {name}: {moments['step']}")
    if state.step != step:
        bad.append(f"train state step {state.step}")
    return bad


class CountingFileSystem(LocalFileSystem):
    """The local filesystem, counting the bytes read through it (protocol "counting")."""

    protocol = "counting"
    bytes_read = 0

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "r" in mode:
            read, readinto = f.read, f.readinto

            def counted_read(*args):
                data = read(*args)
                CountingFileSystem.bytes_read += len(data)
                return data

            def counted_readinto(buf):
                n = readinto(buf)
                CountingFileSystem.bytes_read += n or 0
                return n

            f.read, f.readinto = counted_read, counted_readinto
        return f


@contextlib.contextmanager
def no_unpickling():
    """Anything unpickled inside fails (what `all_gather_object`/`broadcast_object_list` do with
    a peer's bytes): checkpoint metadata from peers must be parsed, never turned into objects."""
    import torch.distributed.distributed_c10d as c10d

    def refuse(*args, **kwargs):
        raise AssertionError("checkpointing unpickled bytes from a peer")

    saved = (pickle.loads, pickle.load, pickle.Unpickler, c10d._unpickler)
    pickle.loads = pickle.load = pickle.Unpickler = c10d._unpickler = refuse
    try:
        yield
    finally:
        pickle.loads, pickle.load, pickle.Unpickler, c10d._unpickler = saved


def register_counting() -> None:
    fsspec.register_implementation("counting", CountingFileSystem, clobber=True)


def counting_url(path: Path | str) -> str:
    return f"counting://{path}"
