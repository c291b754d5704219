"""Job configuration: the schema (trainer/config/schema.py: one dataclass per TOML section, the
field docstrings that docs/config.md is generated from) and loading (trainer/config/load.py:
TOML -> dataclasses -> CLI overrides -> value checks). `from trainer.config import X` is the
public spelling for both."""

from models.errors import ConfigError
from trainer.config.load import (build_config, coerce, field_docs, load_toml, model_args, parse_overrides, parse_value,
                                 resolve_model_args, split_cli, to_toml, validate)
from trainer.config.schema import (SECTIONS, ActivationCheckpointConfig, CheckpointConfig, CompileConfig, Config,
                                   DeviceConfig, FlowConfig, JobConfig, LRSchedulerConfig, MetricsConfig, MoEConfig,
                                   ModelConfig, OptimizerConfig, ParallelismConfig, ProfilingConfig, TrainingConfig,
                                   ValidationConfig)

__all__ = ["SECTIONS", "ActivationCheckpointConfig", "CheckpointConfig", "CompileConfig", "Config", "ConfigError",
           "DeviceConfig", "FlowConfig", "JobConfig", "LRSchedulerConfig", "MetricsConfig", "MoEConfig", "ModelConfig",
           "OptimizerConfig", "ParallelismConfig", "ProfilingConfig", "TrainingConfig", "ValidationConfig",
           "build_config", "coerce", "field_docs", "load_toml", "model_args", "parse_overrides", "parse_value",
           "resolve_model_args", "split_cli", "to_toml", "validate"]
