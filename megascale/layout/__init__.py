"""A 3D layout as pure data: where each rank sits, and which part of each parameter it holds.

No processes and no collectives here, so every package may read it: the mesh builds its groups
from the grid, the optimizer reads a tensor's `ShardSpec` for whole-parameter norms, checkpoints
reshard with it, and the diagnostics place ranks on the grid.
"""

from megascale.layout.grid import Coords, RankGrid
from megascale.layout.shard import ShardSpec, local_piece, set_shard_spec, shard_spec, tp_slice

__all__ = ["Coords", "RankGrid", "ShardSpec", "local_piece", "set_shard_spec", "shard_spec", "tp_slice"]
