"""Structured run configuration (dataclasses) composed by Hydra and validated up front."""

from verity.config.errors import ConfigError
from verity.config.loader import config_to_dict, load_config, named_config_file
from verity.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    TrainerConfig,
    VerityConfig,
)
from verity.config.sections import register_config_section, schema_class
from verity.config.validate import validate_config

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "TrainerConfig",
    "VerityConfig",
    "config_to_dict",
    "load_config",
    "named_config_file",
    "register_config_section",
    "schema_class",
    "validate_config",
]
