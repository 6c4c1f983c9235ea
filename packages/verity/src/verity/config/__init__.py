"""Structured run configuration (dataclasses) composed by Hydra and validated up front."""

from verity.config.loader import (
    ConfigError,
    config_to_dict,
    load_config,
    named_config_file,
    validate_config,
)
from verity.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    VerityConfig,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "VerityConfig",
    "config_to_dict",
    "load_config",
    "named_config_file",
    "validate_config",
]
