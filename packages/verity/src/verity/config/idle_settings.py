"""Settings this run would not read are rejected, not ignored.

A key set away from its default in a part of the config that the run does not use
would change nothing — the critic's section in a run without a critic, the vLLM
options under ``rollout.engine=hf``, a KL coefficient with the KL term off, GAE's
``lam`` under GRPO. Such a run is usually not the one its author meant, so
:func:`check_idle_settings` names every such key, what makes it idle and how to make
it count, before anything is built.

"Default" is the schema's own value (the dataclass default; with ``model.path=embedded``
also the model preset, :mod:`verity.config.model_presets`), so a key left alone or
set to its default is never an error; only a changed value in an idle part is.
When the caller knows which keys the user set (``user_keys``: the config file they chose
and the overrides), only those are rejected; a changed value that a preset brought (the
quickstart's ``actor.fsdp2.*`` tuning under ``actor.engine=megatron``) steps aside with
one logged line instead.
Each idle part is an :class:`IdlePart`: a dotted prefix (a section or one key), the reason
and the fix. Each section names its own, beside its dataclass, in ``idle_parts(cfg)``
(:mod:`verity.config.schema`; a plug-in section may do the same); :func:`idle_parts`
collects them. Plug-in estimators say which ``algorithm.advantage`` keys they read
(``register_advantage_estimator(reads=...)``); one that does not say is not second-guessed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from verity.config.errors import ConfigError

__all__ = [
    "IdlePart",
    "changed_keys",
    "check_idle_settings",
    "engine_option_parts",
    "estimators_fix",
    "idle_parts",
    "reference_parts",
    "replicated_parts",
]

logger = logging.getLogger("verity.config")

# keys of model.* that only the embedded default reads
EMBEDDED_ONLY = ("embedded_sft_steps", "embedded_cache_dir")
# algorithm.advantage keys that belong to particular estimators (eps / whiten_eps are numerical
# guards shared by several and read by plug-in stages; they are not checked)
ESTIMATOR_KEYS = ("gamma", "lam", "gae_whiten", "norm_by_std", "gpg_norm_by_std", "gpg_alpha_correction")
# actor.policy_loss keys named after the one loss that reads them
LOSS_PREFIXES = ("gspo", "cispo", "clip_cov", "kl_cov")
KL_IN_REWARD_KEYS = ("kl_in_reward_kind", "kl_ctrl", "kl_coef", "kl_target", "kl_horizon")
ADAPTIVE_KL_KEYS = ("kl_target", "kl_horizon")
KL_LOSS_KEYS = ("kl_loss_kind", "kl_loss_coef")


@dataclasses.dataclass(frozen=True)
class IdlePart:
    """A part of the config this run does not read: ``prefix`` (a section or a key), why, how to use it."""

    prefix: str
    reason: str
    fix: str
    keep: tuple[str, ...] = ()  # keys under ``prefix`` that the run does read (``critic.enabled``)


def _get(obj: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def changed_keys(cfg: Any, default: Any, prefix: str) -> list[str]:
    """Dotted leaf keys under ``prefix`` whose value in ``cfg`` differs from ``default``'s."""
    value, ref = _get(cfg, prefix), _get(default, prefix)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        keys: list[str] = []
        for f in dataclasses.fields(value):
            keys += changed_keys(cfg, default, f"{prefix}.{f.name}")
        return keys
    return [] if _same(value, ref) else [prefix]


def engine_option_parts(role: Any, section: str, registry: Any) -> list[IdlePart]:
    """The option sections of ``section`` named after a registered engine other than the one it runs."""
    parts = []
    for f in dataclasses.fields(role):
        if f.name != role.engine and f.name in registry:
            parts.append(
                IdlePart(
                    f"{section}.{f.name}",
                    f"{section}.engine={role.engine}",
                    f"they apply to {section}.engine={f.name}",
                )
            )
    return parts


def replicated_parts(role: Any, section: str) -> list[IdlePart]:
    """``<section>.fsdp2.reshard_after_forward`` under ``fsdp2.sharding=replicate`` (whole weights on every rank)."""
    if role.engine != "fsdp2" or role.fsdp2.sharding != "replicate":
        return []
    return [
        IdlePart(
            f"{section}.fsdp2.reshard_after_forward",
            f"{section}.fsdp2.sharding=replicate: every rank keeps whole weights",
            f"it applies to {section}.fsdp2.sharding=full",
        )
    ]


def reference_parts(role: Any, cfg: Any) -> list[IdlePart]:
    """``actor.reference`` when the run builds no reference engine of the fsdp2 kind.

    No KL term: no reference at all; LoRA adapters: the reference is the actor's own model with
    its adapters off; another engine than fsdp2: its reference has no such settings.
    """
    from verity.config.derived import needs_reference

    if not needs_reference(cfg):
        why = "no KL term (algorithm.kl.use_kl_loss and use_kl_in_reward are false): no reference is built"
        return [IdlePart("actor.reference", why, "turn a KL term on")]
    if role.lora.enabled:
        why = f"actor.lora.rank={role.lora.rank}: the reference is the actor's model with its adapters off"
        return [IdlePart("actor.reference", why, "it applies to a separate reference (actor.lora.rank=0)")]
    if role.engine != "fsdp2":
        why, fix = f"actor.engine={role.engine}", "it applies to actor.engine=fsdp2"
        return [IdlePart("actor.reference", why, fix)]
    return []


def estimators_fix(key: str) -> str:
    """How to make ``algorithm.advantage.<key>`` count: the estimators that read it."""
    readers = estimators_reading(key)
    if not readers:
        return "no registered estimator reads it"
    return "it applies to algorithm.advantage.estimator=" + "|".join(readers)


def estimators_reading(key: str) -> list[str]:
    """Registered estimators (canonical names) that declare reading ``algorithm.advantage.<key>``."""
    from verity.algorithms.registry import ADVANTAGE_ESTIMATORS

    return [n for n, spec in ADVANTAGE_ESTIMATORS.items() if spec.reads is not None and key in spec.reads]


def idle_parts(cfg: Any) -> list[IdlePart]:
    """Every part of ``cfg`` that this run does not read, with the reason and the fix: what each
    section's ``idle_parts(cfg)`` names (the schema's sections and plug-in sections alike)."""
    import verity.algorithms  # noqa: F401  (fills the registries the sections consult)

    parts: list[IdlePart] = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        name_parts = getattr(section, "idle_parts", None)
        if callable(name_parts):
            parts += name_parts(cfg)
    return parts


def check_idle_settings(cfg: Any, user_keys: set[str] | None = None, source: str = "the preset") -> None:
    """Raise :class:`ConfigError` listing every key set away from its default where the run does not read it.

    ``user_keys``: the dotted keys the user set (None: every changed key counts as theirs).
    A changed key outside it came from ``source`` and is left aside with one logged line.
    """
    default = type(cfg)()
    if cfg.model.path == "embedded":  # a model preset's values count as defaults too
        from verity.config.model_presets import apply_model_preset

        default.actor.engine = cfg.actor.engine  # it sets actor.fsdp2 keys only for the fsdp2 engine
        default.model.embedded_preset = cfg.model.embedded_preset  # whose config preset applies
        apply_model_preset(default, set())
    lines = []
    for part in idle_parts(cfg):
        keys = [
            key
            for key in changed_keys(cfg, default, part.prefix)
            if not any(key == k or key.startswith(k + ".") for k in part.keep)
        ]
        aside = [key for key in keys if user_keys is not None and key not in user_keys]
        keys = [key for key in keys if key not in aside]
        if aside:
            names = f"{part.prefix}.* settings" if len(aside) > 1 or aside[0] != part.prefix else part.prefix
            logger.warning(
                "%s: %s's %s do not apply and are left aside (%s)",
                part.reason,
                source,
                names,
                ", ".join(aside),
            )
        if keys:
            values = ", ".join(f"{key}={_get(cfg, key)!r}" for key in keys)
            lines.append(f"  {values}: {part.reason}; {part.fix}")
    if lines:
        raise ConfigError(
            "these settings would have no effect in this run (a key is used or rejected, never ignored):\n"
            + "\n".join(lines)
        )
