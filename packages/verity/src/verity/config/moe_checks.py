"""``actor.moe``, checked before any worker starts.

Every key of the section needs a mixture-of-experts policy (a model whose config names routed
experts: Qwen2-MoE, Qwen3-MoE); on a dense model a key set away from its default is refused.
The keys are read by the ``fsdp2`` and ``megatron`` training engines (the Megatron-core engine on
one pipeline stage: ``actor.megatron.pipeline_parallel_size=1``).
Rollout routing replay (``actor.moe.routing_replay``) needs a rollout that records routes (the
``hf`` engine without tensor parallelism; vLLM and SGLang do not return them), the synchronous loop
(the rollout in the actor's workers) and no sequence parallelism (routes are replayed on the padded
layout).
"""

from __future__ import annotations

from typing import Any

from verity.config.errors import ConfigError

__all__ = ["MOE_ENGINES", "MOE_MODEL_TYPES", "check_moe", "is_moe_config"]

#: HF model types whose sparse blocks verity reads routes from and replays routes into
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
#: training engines that read actor.moe (router losses, metrics, routing replay)
MOE_ENGINES = ("fsdp2", "megatron")


def is_moe_config(text_config: Any) -> bool:
    """Whether an HF text config describes routed experts (``num_experts`` > 1 and top-k >= 1)."""
    experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
    return bool(experts and experts > 1 and getattr(text_config, "num_experts_per_tok", 0))


def check_moe(cfg: Any) -> None:
    """Refuse ``actor.moe`` settings the run cannot honour, naming the key (see the module docstring)."""
    moe = cfg.actor.moe
    set_keys = [
        f"actor.moe.{name}={str(getattr(moe, name)).lower()}"
        for name, default in (("aux_loss_coef", 0.0), ("z_loss_coef", 0.0), ("routing_replay", False))
        if getattr(moe, name) != default
    ]
    if not set_keys:
        return
    from verity.config.sequence_parallel_checks import model_text_config

    text, _ = model_text_config(cfg, cfg.model.path)
    model_type = getattr(text, "model_type", "?")
    if not is_moe_config(text) or model_type not in MOE_MODEL_TYPES:
        raise ConfigError(
            f"{set_keys[0]} needs a mixture-of-experts model ({', '.join(MOE_MODEL_TYPES)}), but model.path is "
            f"a {model_type!r} model without routed experts; leave actor.moe at its defaults"
        )
    if cfg.actor.engine not in MOE_ENGINES:
        raise ConfigError(
            f"{set_keys[0]} needs actor.engine fsdp2 or megatron: the {cfg.actor.engine!r} engine does not "
            "read actor.moe"
        )
    stages = int(cfg.actor.megatron.pipeline_parallel_size)
    if cfg.actor.engine == "megatron" and stages != 1:
        raise ConfigError(
            f"{set_keys[0]} needs actor.megatron.pipeline_parallel_size=1, not {stages}: the megatron engine "
            "computes router terms and replays routes on one pipeline stage only"
        )
    if not moe.routing_replay:
        return
    key = "actor.moe.routing_replay=true"
    if cfg.rollout.engine != "hf":
        raise ConfigError(
            f"{key} needs a rollout that records each token's experts: rollout.engine=hf, "
            f"not {cfg.rollout.engine!r} (it returns no routes)"
        )
    if cfg.trainer.mode != "sync":
        raise ConfigError(
            f"{key} needs trainer.mode=sync (the rollout in the actor's workers), not {cfg.trainer.mode!r}"
        )
    if cfg.actor.fsdp2.ulysses_sequence_parallel_size != 1:
        raise ConfigError(
            f"{key} replays routes on the padded layout, which sequence parallelism does not run: "
            "actor.fsdp2.ulysses_sequence_parallel_size must be 1"
        )
    if cfg.rollout.tensor_parallel_size != 1:
        raise ConfigError(
            f"{key} needs rollout.tensor_parallel_size=1, not {cfg.rollout.tensor_parallel_size}"
        )
    if cfg.rollout.agent.enabled:
        raise ConfigError(
            f"{key} needs single-turn rollouts: the agent loop (rollout.agent.enabled=true) generates "
            "request by request, and its requests record no routes"
        )
