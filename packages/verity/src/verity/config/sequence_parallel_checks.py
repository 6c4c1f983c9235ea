"""Ulysses sequence parallelism (``actor.fsdp2.ulysses_sequence_parallel_size``, also ``critic.``), checked before start.

An SP group is ``s`` consecutive ranks of the role's workers: it must stay inside a node, the workers
must cut into whole groups, and ``s`` must divide the model's attention heads and key/value heads
(each rank attends with ``1/s`` of each). Only the FSDP2 engine splits sequences: Megatron-core's
context parallelism needs TransformerEngine's attention (CUDA), which verity does not wire in, so
the Megatron engine is refused. SP splits the packed layout, so ``fsdp2.packed=false`` is refused
beside it. Vision-language models and LoRA adapters are refused too (not split or not tested yet). The reference policy runs the actor's ``fsdp2`` settings, so it follows.
"""

from __future__ import annotations

import os
from typing import Any

from verity.config.errors import ConfigError

__all__ = ["check_sequence_parallel", "model_text_config"]


def model_text_config(cfg: Any, path: str) -> tuple[Any, bool]:
    """``(text config, has a vision tower)`` of the model at ``path`` (``embedded``: the preset's shape)."""
    if path == "embedded":
        from verity.data.embedded import embedded_preset

        model = embedded_preset(cfg.model.embedded_preset).fresh_model(cfg.trainer.seed)[0].config
    else:
        from transformers import AutoConfig

        model = AutoConfig.from_pretrained(os.path.expanduser(path), local_files_only=True)
    text = model.get_text_config() if hasattr(model, "get_text_config") else model
    return text, text is not model


def _role_workers(cfg: Any, section: str) -> tuple[int, int | None, str]:
    """``(workers, workers per node or None, the key naming them)`` of the actor or the critic."""
    from verity.config.cluster_checks import actor_workers_per_node

    critic = cfg.critic
    if section == "critic" and critic.placement == "separate":
        workers = int(critic.n_workers or cfg.trainer.n_workers)
        return workers, (workers // critic.nnodes if critic.nnodes else None), "critic.n_workers"
    return int(cfg.trainer.n_workers), actor_workers_per_node(cfg), "trainer.n_workers"


def _check_role(cfg: Any, section: str) -> None:
    role = getattr(cfg, section)
    size = int(role.fsdp2.ulysses_sequence_parallel_size)
    key = f"{section}.fsdp2.ulysses_sequence_parallel_size = {size}"
    if size == 1:
        return
    if role.engine != "fsdp2":
        raise ConfigError(
            f"{key} needs {section}.engine=fsdp2: the {role.engine!r} engine does not split sequences "
            "(Megatron-core's context parallelism needs TransformerEngine on GPUs, not wired in verity)"
        )
    if role.fsdp2.packed is False:
        raise ConfigError(
            f"{key} splits the packed layout, so {section}.fsdp2.packed=false cannot be kept; unset it or use size 1"
        )
    if section == "actor" and cfg.actor.lora.enabled:
        raise ConfigError(
            f"{key} with LoRA adapters (actor.lora.rank > 0) is not supported yet; set one of them off"
        )
    workers, per_node, workers_key = _role_workers(cfg, section)
    if workers % size:
        raise ConfigError(
            f"{key} must divide {workers_key} = {workers}: every SP group needs {size} whole ranks"
        )
    if per_node is not None and per_node % size:
        raise ConfigError(
            f"{key} must divide the {per_node} workers per node: an SP group exchanges heads every layer and "
            "must stay inside one node"
        )
    path = (
        critic_path if section == "critic" and (critic_path := cfg.critic.model_path) else None
    ) or cfg.model.path
    text, vision = model_text_config(cfg, path)
    if vision:
        raise ConfigError(
            f"{key}: {path} has a vision tower, and vision-language models are not split by sequence"
        )
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % size or kv_heads % size:
        raise ConfigError(
            f"{key} must divide the model's {heads} attention heads and {kv_heads} key/value heads ({path}); "
            "pick a size that divides both"
        )


def check_sequence_parallel(cfg: Any) -> None:
    """The actor's and (when the run has one) the critic's SP size against engine, workers, nodes and heads."""
    from verity.config.derived import needs_critic

    _check_role(cfg, "actor")
    if needs_critic(cfg):
        _check_role(cfg, "critic")
