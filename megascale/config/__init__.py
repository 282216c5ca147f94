"""Typed job configuration: dataclasses, TOML loading and command-line overrides."""

from megascale.config.fields import ConfigError
from megascale.config.loader import default_config_path, dump_config, load_config, to_dict
from megascale.config.operations import CheckpointConfig, DiagnosticsConfig
from megascale.config.schema import DataConfig, JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DiagnosticsConfig",
    "JobConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "default_config_path",
    "dump_config",
    "load_config",
    "to_dict",
]
