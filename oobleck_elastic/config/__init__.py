"""Typed, frozen job configuration loaded from YAML, with `--set` overrides."""

from oobleck_elastic.config.loader import apply_overrides, load_config, read_yaml
from oobleck_elastic.config.parse import parse_section
from oobleck_elastic.config.schema import (
    CheckpointConfig,
    DataConfig,
    ElasticConfig,
    EvalConfig,
    JobConfig,
    LRScheduleConfig,
    MonitoringConfig,
    OptimizerConfig,
    PlannerConfig,
    TrainConfig,
    parse_bytes,
)

__all__ = [
    "CheckpointConfig", "DataConfig", "ElasticConfig", "EvalConfig", "JobConfig", "LRScheduleConfig",
    "MonitoringConfig", "OptimizerConfig", "PlannerConfig", "TrainConfig", "apply_overrides", "load_config",
    "parse_bytes", "parse_section", "read_yaml",
]
