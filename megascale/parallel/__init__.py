"""3D parallelism applied from outside the model: the process-group mesh and its fast start-up,
tensor/sequence parallel with collective GEMMs, the pipeline runtime, ZeRO-2, the engine."""

from megascale.parallel.mesh import ParallelMesh, init_mesh

__all__ = ["ParallelMesh", "init_mesh"]
