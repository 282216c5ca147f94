"""3D-parallel layout: the rank grid, the process-group mesh and its fast start-up."""

from megascale.parallel.grid import RankGrid
from megascale.parallel.mesh import ParallelMesh, init_mesh

__all__ = ["ParallelMesh", "RankGrid", "init_mesh"]
