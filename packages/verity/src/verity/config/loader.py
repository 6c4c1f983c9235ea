"""Compose a run configuration with Hydra and validate it before any compute starts.

    cfg = load_config(["actor.optim.lr=1e-5", "trainer.total_steps=10"])
    cfg = load_config(overrides, config_file="recipes/grpo/configs/cpu.yaml")

A config file is YAML whose keys are a subset of :class:`VerityConfig`; it may start
with ``defaults: [verity, _self_]`` (added when missing). Overrides use Hydra's grammar.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from verity.config.schema import VerityConfig

SCHEMA_NAME = "verity"


class ConfigError(ValueError):
    """A configuration that cannot run: names the key and what was expected."""


def _register_schema() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=VerityConfig)


def load_config(overrides: Sequence[str] = (), config_file: str | os.PathLike | None = None) -> VerityConfig:
    """Compose ``VerityConfig`` from an optional YAML file plus command-line overrides.

    Raises :class:`ConfigError` naming the offending key for unknown keys, wrong types
    and a missing config file. The result is validated by :func:`validate_config`.
    """
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        if config_file is None:
            with initialize(version_base="1.3", config_path=None):
                raw = compose(config_name=SCHEMA_NAME, overrides=list(overrides))
        else:
            path = Path(config_file).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"config file {str(config_file)!r} does not exist")
            _ensure_schema_default(path)
            with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
                raw = compose(config_name=path.stem, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        cause = f" ({str(err.__cause__).splitlines()[0]})" if err.__cause__ else ""
        raise ConfigError(f"invalid configuration: {str(err).splitlines()[0]}{cause}") from None
    finally:
        GlobalHydra.instance().clear()
    cfg = OmegaConf.to_object(raw)
    assert isinstance(cfg, VerityConfig)
    validate_config(cfg)
    return cfg


def _ensure_schema_default(path: Path) -> None:
    text = path.read_text()
    data = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    defaults = data.get("defaults") if isinstance(data, dict) or OmegaConf.is_dict(data) else None
    if not defaults or SCHEMA_NAME not in [d if isinstance(d, str) else None for d in defaults]:
        raise ConfigError(
            f"config file {str(path)!r} must start with 'defaults: [{SCHEMA_NAME}, _self_]' "
            "so its keys are checked against the schema"
        )


def config_to_dict(cfg: VerityConfig) -> dict:
    """The config as a plain nested dict (for logging, hashing and summary files)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def validate_config(cfg: VerityConfig) -> None:
    """Check the arithmetic of batch sizes and the value ranges before any worker starts.

    Raises :class:`ConfigError` whose message names the key(s) and shows the arithmetic.
    """
    d, a, r, t = cfg.data, cfg.actor, cfg.rollout, cfg.trainer
    positive = {
        "data.train_batch_size": d.train_batch_size,
        "data.val_batch_size": d.val_batch_size,
        "data.max_prompt_length": d.max_prompt_length,
        "data.max_response_length": d.max_response_length,
        "rollout.n": r.n,
        "rollout.micro_batch_size": r.micro_batch_size,
        "actor.ppo_mini_batch_size": a.ppo_mini_batch_size,
        "actor.ppo_epochs": a.ppo_epochs,
        "actor.micro_batch_size": a.micro_batch_size,
        "trainer.n_workers": t.n_workers,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if t.total_steps < 0:
        raise ConfigError(f"trainer.total_steps must be >= 0, got {t.total_steps}")
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size ({d.train_batch_size} prompts) must be a multiple of "
            f"actor.ppo_mini_batch_size ({a.ppo_mini_batch_size} prompts)"
        )
    rows = a.ppo_mini_batch_size * r.n
    if rows % t.n_workers:
        raise ConfigError(
            f"a mini-batch of actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size} x {r.n} "
            f"= {rows} rows does not divide over trainer.n_workers = {t.n_workers} workers"
        )
    if a.optim.lr < 0:
        raise ConfigError(f"actor.optim.lr must be >= 0, got {a.optim.lr}")
    if r.temperature < 0:
        raise ConfigError(f"rollout.temperature must be >= 0, got {r.temperature}")
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if d.truncation not in ("error", "filter", "truncate_left", "truncate_right"):
        raise ConfigError(
            f"data.truncation must be one of error|filter|truncate_left|truncate_right, got {d.truncation!r}"
        )
    _validate_algorithm_choices(cfg)
    _validate_critic(cfg)
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}")
    if cfg.model.path != "embedded" and not Path(cfg.model.path).expanduser().is_dir():
        raise ConfigError(f"model.path {cfg.model.path!r} is not a local HF checkpoint folder")
    if cfg.model.path != "embedded" and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        raise ConfigError(f"model.path {cfg.model.path!r} has no config.json: not an HF checkpoint folder")
    if cfg.model.tokenizer_path and not Path(cfg.model.tokenizer_path).expanduser().is_dir():
        raise ConfigError(f"model.tokenizer_path {cfg.model.tokenizer_path!r} is not a local folder")
    _validate_fault_tolerance(cfg)
    for key in ("train_files", "val_files"):
        for f in getattr(d, key):
            if not Path(f).expanduser().is_file():
                raise ConfigError(f"data.{key}: file {f!r} does not exist")
    if cfg.reward.custom_path and not Path(cfg.reward.custom_path).expanduser().is_file():
        raise ConfigError(f"reward.custom_path: file {cfg.reward.custom_path!r} does not exist")


def _validate_fault_tolerance(cfg: VerityConfig) -> None:
    """Checkpoint, resume, stage time-limit and malformed-row settings."""
    t = cfg.trainer
    if cfg.data.on_malformed not in ("error", "skip"):
        raise ConfigError(f"data.on_malformed must be error or skip, got {cfg.data.on_malformed!r}")
    if t.checkpoint.every < 0:
        raise ConfigError(
            f"trainer.checkpoint.every must be >= 0 (0: no periodic checkpoints), got {t.checkpoint.every}"
        )
    if t.checkpoint.keep < 0:
        raise ConfigError(f"trainer.checkpoint.keep must be >= 0 (0: keep all), got {t.checkpoint.keep}")
    if t.stage_timeout_s < 0:
        raise ConfigError(f"trainer.stage_timeout_s must be >= 0 (0: no limit), got {t.stage_timeout_s}")
    if not t.resume:
        raise ConfigError("trainer.resume must be auto, off or a checkpoint path, got an empty value")
    if t.resume not in ("auto", "off") and not Path(t.resume).expanduser().exists():
        raise ConfigError(
            f"trainer.resume: {t.resume!r} is neither auto, off nor an existing checkpoint path"
        )


def _validate_algorithm_choices(cfg: VerityConfig) -> None:
    """Registry names exist and each algorithm sub-config's own checks pass."""
    import verity.algorithms  # noqa: F401  (fills the registries)
    from verity.algorithms.registry import (
        ADVANTAGE_ESTIMATORS,
        AGGREGATION_MODES,
        KL_ESTIMATORS,
        POLICY_LOSSES,
        UnknownNameError,
    )

    kl = cfg.algorithm.kl
    choices = [
        ("algorithm.advantage.estimator", ADVANTAGE_ESTIMATORS, cfg.algorithm.advantage.estimator),
        ("actor.policy_loss.name", POLICY_LOSSES, cfg.actor.policy_loss.name),
        ("actor.policy_loss.loss_agg_mode", AGGREGATION_MODES, cfg.actor.policy_loss.loss_agg_mode),
        ("algorithm.kl.kl_loss_kind", KL_ESTIMATORS, kl.kl_loss_kind),
        ("algorithm.kl.kl_in_reward_kind", KL_ESTIMATORS, kl.kl_in_reward_kind),
    ]
    for key, registry, name in choices:
        try:
            registry.get(name)
        except UnknownNameError as err:
            raise ConfigError(f"{key}: {err}") from None
    subs = [
        ("algorithm.advantage", cfg.algorithm.advantage),
        ("algorithm.kl", kl),
        ("actor.policy_loss", cfg.actor.policy_loss),
    ]
    for key, sub in subs:
        try:
            sub.validate()
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None


def _validate_critic(cfg: VerityConfig) -> None:
    """The critic section: on when the estimator needs values, batch arithmetic, value-loss settings."""
    from verity.algorithms.advantages import estimators_needing
    from verity.algorithms.configs import ValueLossConfig
    from verity.algorithms.registry import AGGREGATION_MODES, UnknownNameError

    c, estimator = cfg.critic, cfg.algorithm.advantage.estimator
    needs_values = estimator in estimators_needing("values")
    if c.enabled is False and needs_values:
        raise ConfigError(
            f"algorithm.advantage.estimator={estimator!r} needs critic values but critic.enabled=false; "
            "set critic.enabled=true (or null for auto)"
        )
    if not (c.enabled or needs_values):
        return
    for key in ("ppo_mini_batch_size", "ppo_epochs", "micro_batch_size"):
        if getattr(c, key) < 1:
            raise ConfigError(f"critic.{key} must be >= 1, got {getattr(c, key)}")
    if c.warmup_steps < 0:
        raise ConfigError(f"critic.warmup_steps must be >= 0, got {c.warmup_steps}")
    if cfg.data.train_batch_size % c.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size} prompts) must be a multiple of "
            f"critic.ppo_mini_batch_size ({c.ppo_mini_batch_size} prompts)"
        )
    rows = c.ppo_mini_batch_size * cfg.rollout.n
    if rows % cfg.trainer.n_workers:
        raise ConfigError(
            f"a critic mini-batch of critic.ppo_mini_batch_size x rollout.n = {c.ppo_mini_batch_size} x "
            f"{cfg.rollout.n} = {rows} rows does not divide over trainer.n_workers = {cfg.trainer.n_workers}"
        )
    if c.optim.lr < 0:
        raise ConfigError(f"critic.optim.lr must be >= 0, got {c.optim.lr}")
    try:
        AGGREGATION_MODES.get(c.loss_agg_mode)
    except UnknownNameError as err:
        raise ConfigError(f"critic.loss_agg_mode: {err}") from None
    try:
        ValueLossConfig(cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode).validate()
    except ValueError as err:
        raise ConfigError(f"critic: {err}") from None
    if c.model_path is not None and not Path(c.model_path).expanduser().is_dir():
        raise ConfigError(f"critic.model_path {c.model_path!r} is not a local HF checkpoint folder")


def named_config_file(directory: str | Path, name: str) -> Path:
    """``<directory>/<name>.yaml``, or FileNotFoundError naming the directory and the configs it has.

    Recipe packages use it for their pinned configs: ``named_config_file(FOLDER / "configs", "cpu")``.
    """
    directory = Path(directory)
    path = directory / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml"))) or "none"
        raise FileNotFoundError(f"no config {name!r} in {directory}; known: {known}")
    return path
