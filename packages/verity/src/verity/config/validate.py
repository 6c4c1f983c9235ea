"""Check a composed run config before any compute starts.

Every check raises :class:`~verity.config.errors.ConfigError` naming the key(s), the
value and what was expected (with the arithmetic, for batch sizes): batch arithmetic,
value ranges, registry names (engines, estimators, losses), the critic and reward-model
sections, plug-in sections (their own ``validate()``), files and folders that must
exist, and the fault-tolerance settings.
"""

from __future__ import annotations

from pathlib import Path

from verity.config.errors import ConfigError
from verity.config.model_checks import check_model_folders
from verity.config.schema import VerityConfig

PLACEMENTS = ("colocated", "separate")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


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
    _validate_optim("actor.optim", a.optim)
    from verity.config.derived import OLD_LOGPROBS_MODES

    if a.old_logprobs not in OLD_LOGPROBS_MODES:
        raise ConfigError(
            f"actor.old_logprobs must be one of {'|'.join(OLD_LOGPROBS_MODES)}, got {a.old_logprobs!r}"
        )
    if a.old_logprobs == "rollout" and cfg.algorithm.kl.use_kl_in_reward:
        raise ConfigError(
            "actor.old_logprobs=rollout with algorithm.kl.use_kl_in_reward: the KL in the reward needs the "
            "trainer's own log-probs; use actor.old_logprobs=recompute (or auto)"
        )
    _validate_engines(cfg)
    _validate_lora(cfg)
    if r.temperature < 0:
        raise ConfigError(f"rollout.temperature must be >= 0, got {r.temperature}")
    if r.val_temperature < 0:
        raise ConfigError(f"rollout.val_temperature must be >= 0 (0: greedy), got {r.val_temperature}")
    if r.val_n < 1:
        raise ConfigError(f"rollout.val_n must be >= 1 (samples per held-out prompt), got {r.val_n}")
    if r.val_n > 1 and r.val_temperature <= 0:
        raise ConfigError(
            f"rollout.val_n = {r.val_n} samples per held-out prompt need sampling: set rollout.val_temperature > 0 "
            "(greedy decoding would repeat one response)"
        )
    if r.val_top_p is not None and not 0.0 < r.val_top_p <= 1.0:
        raise ConfigError(f"rollout.val_top_p must be in (0, 1] or null (rollout.top_p), got {r.val_top_p}")
    if cfg.model.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"model.attn_implementation must be one of {'|'.join(ATTN_IMPLEMENTATIONS)}, "
            f"got {cfg.model.attn_implementation!r}"
        )
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if d.truncation not in ("error", "filter", "truncate_left", "truncate_right"):
        raise ConfigError(
            f"data.truncation must be one of error|filter|truncate_left|truncate_right, got {d.truncation!r}"
        )
    _validate_algorithm_choices(cfg)
    _validate_agent(cfg)
    _validate_critic(cfg)
    _validate_reward_model(cfg)
    _validate_plugin_sections(cfg)
    _validate_embedded_preset(cfg)
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}")
    if cfg.model.path != "embedded" and not Path(cfg.model.path).expanduser().is_dir():
        raise ConfigError(f"model.path {cfg.model.path!r} is not a local HF checkpoint folder")
    if cfg.model.path != "embedded" and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        raise ConfigError(f"model.path {cfg.model.path!r} has no config.json: not an HF checkpoint folder")
    if cfg.model.tokenizer_path and not Path(cfg.model.tokenizer_path).expanduser().is_dir():
        raise ConfigError(f"model.tokenizer_path {cfg.model.tokenizer_path!r} is not a local folder")
    check_model_folders(cfg)  # config.json readable, model_type known to transformers
    _validate_fault_tolerance(cfg)
    for key in ("train_files", "val_files"):
        for f in getattr(d, key):
            if not Path(f).expanduser().is_file():
                raise ConfigError(f"data.{key}: file {f!r} does not exist")
    if cfg.reward.custom_path and not Path(cfg.reward.custom_path).expanduser().is_file():
        raise ConfigError(f"reward.custom_path: file {cfg.reward.custom_path!r} does not exist")


def _validate_embedded_preset(cfg: VerityConfig) -> None:
    """``model.embedded_preset`` names a registered preset whose teacher is registered too."""
    from verity.data.embedded_presets import EMBEDDED_PRESETS, SFT_TEACHERS
    from verity.registry import UnknownNameError

    m = cfg.model
    if m.embedded_sft_steps is not None and m.embedded_sft_steps < 0:
        raise ConfigError(
            f"model.embedded_sft_steps must be >= 0 (0: no warm-start), got {m.embedded_sft_steps}"
        )
    if m.path != "embedded":
        if m.embedded_preset != "default":
            raise ConfigError(
                f"model.embedded_preset = {m.embedded_preset!r} applies only to model.path=embedded "
                f"(model.path is {m.path!r})"
            )
        return
    try:
        settings = EMBEDDED_PRESETS.get(m.embedded_preset)
        SFT_TEACHERS.get(settings.teacher)
    except UnknownNameError as err:
        raise ConfigError(f"model.embedded_preset: {err}") from None


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
    _validate_optim("critic.optim", c.optim)
    _validate_placement("critic", c.placement, c.n_workers)
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


def _validate_optim(key: str, optim: object) -> None:
    try:
        optim.validate()  # type: ignore[attr-defined]
    except ValueError as err:
        raise ConfigError(f"{key}.{err}") from None


def _validate_engines(cfg: VerityConfig) -> None:
    """``actor.engine``, ``critic.engine`` (when there is a critic) and ``rollout.engine`` are registered."""
    from verity.algorithms.advantages import estimators_needing
    from verity.engines.registry import TRAINING_ENGINES
    from verity.registry import UnknownNameError
    from verity.rollout.registry import ROLLOUT_ENGINES

    choices = [
        ("actor.engine", TRAINING_ENGINES, cfg.actor.engine),
        ("rollout.engine", ROLLOUT_ENGINES, cfg.rollout.engine),
    ]
    has_critic = cfg.critic.enabled or (
        cfg.critic.enabled is None and cfg.algorithm.advantage.estimator in estimators_needing("values")
    )
    if has_critic:
        choices.append(("critic.engine", TRAINING_ENGINES, cfg.critic.engine))
    for key, registry, name in choices:
        try:
            registry.get(name)
        except UnknownNameError as err:
            raise ConfigError(f"{key}: {err}") from None
    options = getattr(cfg.rollout, cfg.rollout.engine, None)
    check = getattr(options, "validate", None)
    if callable(check):
        try:
            check()
        except ValueError as err:
            raise ConfigError(f"rollout.{cfg.rollout.engine}.{err}") from None
    if has_critic and not TRAINING_ENGINES.get(cfg.critic.engine).trains_values:
        raise ConfigError(f"critic.engine: the {cfg.critic.engine!r} engine cannot train value models")
    if cfg.actor.engine == "megatron":
        _validate_megatron(cfg, has_critic)


def _validate_lora(cfg: VerityConfig) -> None:
    """``actor.lora``: its own ranges, an engine that trains adapters, ``peft`` installed."""
    from verity.engines.lora import peft_available
    from verity.engines.registry import TRAINING_ENGINES

    lora = cfg.actor.lora
    try:
        lora.validate()
    except ValueError as err:
        raise ConfigError(f"actor.lora.{err}") from None
    if not lora.enabled:
        return
    if not TRAINING_ENGINES.get(cfg.actor.engine).supports_adapters:
        raise ConfigError(
            f"actor.lora.rank={lora.rank}: the {cfg.actor.engine!r} training engine (actor.engine) does not "
            "train LoRA adapters; use actor.engine=fsdp2, or actor.lora.rank=0 to train every weight"
        )
    if not peft_available():
        raise ConfigError(f"actor.lora.rank={lora.rank} needs the peft package, which is not installed: pip install peft")


def _validate_megatron(cfg: VerityConfig, has_critic: bool) -> None:
    """``actor.megatron`` sizes, and what the megatron engine does not support in this version."""
    from verity.engines.megatron import megatron_available

    if not megatron_available():
        raise ConfigError(
            "actor.engine=megatron needs megatron-core, which is not installed: "
            "pip install 'verity[megatron]' (megatron-core 0.16.1, see docs/engines.md)"
        )
    options = cfg.actor.megatron
    try:
        options.validate()
    except ValueError as err:
        raise ConfigError(f"actor.{err}") from None
    model_parallel = options.tensor_parallel_size * options.pipeline_parallel_size
    if cfg.trainer.n_workers % model_parallel:
        raise ConfigError(
            f"trainer.n_workers = {cfg.trainer.n_workers} is not a multiple of actor.megatron."
            f"tensor_parallel_size x pipeline_parallel_size = {model_parallel}"
        )
    if has_critic:
        raise ConfigError(
            "actor.engine=megatron: runs with a critic are not supported yet (the critic's engine would "
            "need the actor's data-parallel layout); use actor.engine=fsdp2 for gae / critic runs"
        )
    if cfg.model.gradient_checkpointing:
        raise ConfigError("model.gradient_checkpointing: the megatron engine does not recompute activations")
    if cfg.model.dtype != "float32":
        raise ConfigError(
            f"model.dtype={cfg.model.dtype!r}: the megatron engine trains in float32 only "
            "(bf16 mixed precision is not implemented for it)"
        )


def _validate_placement(section: str, placement: str, n_workers: int | None) -> None:
    if placement not in PLACEMENTS:
        raise ConfigError(f"{section}.placement must be one of {'|'.join(PLACEMENTS)}, got {placement!r}")
    if n_workers is not None and n_workers < 1:
        raise ConfigError(f"{section}.n_workers must be >= 1 (or null: trainer.n_workers), got {n_workers}")
    if n_workers is not None and placement == "colocated":
        raise ConfigError(
            f"{section}.n_workers = {n_workers} applies only to placement=separate; a colocated role "
            "runs in the actor's trainer.n_workers processes"
        )


def _validate_reward_model(cfg: VerityConfig) -> None:
    rm = cfg.reward_model
    if not rm.enabled:
        return
    if not rm.model_path:
        raise ConfigError("reward_model.enabled=true needs reward_model.model_path (a local HF folder)")
    if not (Path(rm.model_path).expanduser() / "config.json").is_file():
        raise ConfigError(f"reward_model.model_path {rm.model_path!r} is not a local HF checkpoint folder")
    if rm.tokenizer_path and not Path(rm.tokenizer_path).expanduser().is_dir():
        raise ConfigError(f"reward_model.tokenizer_path {rm.tokenizer_path!r} is not a local folder")
    for key in ("max_length", "micro_batch_size"):
        if getattr(rm, key) < 1:
            raise ConfigError(f"reward_model.{key} must be >= 1, got {getattr(rm, key)}")
    _validate_placement("reward_model", rm.placement, rm.n_workers)


def _validate_agent(cfg: VerityConfig) -> None:
    """``rollout.agent``: its own ranges and, when enabled, every tool resolved (schema parsed, code imported)."""
    try:
        cfg.rollout.agent.validate()
    except ValueError as err:
        raise ConfigError(f"rollout.agent.{err}") from None


def _validate_plugin_sections(cfg: VerityConfig) -> None:
    """Each plug-in section's own checks; errors name the section.

    ``validate()`` checks the section alone; ``validate_run(cfg)``, when the section has
    one, then checks what needs the whole run config (another section's value, batch
    arithmetic). Either raises ``ValueError``.
    """
    from verity.config.sections import plugin_sections

    sections = plugin_sections(cfg)
    for name, section in sections.items():
        check = getattr(section, "validate", None)
        if not callable(check):
            continue
        try:
            check()
        except ValueError as err:
            raise ConfigError(f"{name}: {err}") from None
    for name, section in sections.items():
        check_run = getattr(section, "validate_run", None)
        if not callable(check_run):
            continue
        try:
            check_run(cfg)
        except ValueError as err:
            raise ConfigError(f"{name}: {err}") from None
