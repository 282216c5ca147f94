"""Pipeline parallelism: model splitting, schedules as data, and the decoupled P2P runtime."""

from megascale.parallel.pipeline.runtime import PipelineRunner
from megascale.parallel.pipeline.schedule import Action, Op, Schedule, build_schedule, simulate
from megascale.parallel.pipeline.split import PipelineChunk, split_model

__all__ = ["Action", "Op", "PipelineChunk", "PipelineRunner", "Schedule", "build_schedule", "simulate", "split_model"]
