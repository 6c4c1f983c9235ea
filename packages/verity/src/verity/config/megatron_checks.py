"""Expert parallelism of the Megatron engine (``actor.megatron.expert_parallel_size``), checked before any worker starts.

An expert-parallel (EP) group is ``expert_parallel_size`` consecutive data-parallel ranks
(``EP x tensor_parallel_size`` consecutive workers) that split each MoE layer's experts
and exchange tokens by all-to-all in every layer, forward and backward: the
bandwidth-hungry traffic of an MoE model, kept inside a node like a tensor-parallel group
(:func:`verity.config.cluster_checks.model_parallel_size` gives the placement plan the
group, :func:`verity.config.cluster_checks.validate_cluster_shape` checks a fixed
per-node count). Here: the arithmetic of the sizes, then the model itself (read from
its ``config.json``, or the embedded preset's shape): a mixture-of-experts model this
engine converts, experts the EP size divides, whole experts per rank.
"""

from __future__ import annotations

from typing import Any

from verity.config.errors import ConfigError

__all__ = ["check_expert_sizes", "check_megatron_model", "expert_group_size"]


def expert_group_size(cfg: Any) -> int:
    """Consecutive actor ranks of one expert-parallel group (EP x TP; 1 for another engine or EP=1)."""
    if cfg.actor.engine != "megatron":
        return 1
    options = cfg.actor.megatron
    ep = int(options.expert_parallel_size)
    return ep * int(options.tensor_parallel_size) if ep > 1 else 1


def check_expert_sizes(cfg: Any) -> None:
    """``expert_parallel_size`` divides the data-parallel size ``n_workers / (TP x PP)``."""
    options = cfg.actor.megatron
    ep = int(options.expert_parallel_size)
    if ep == 1:
        return
    model_parallel = int(options.tensor_parallel_size) * int(options.pipeline_parallel_size)
    dp = cfg.trainer.n_workers // model_parallel
    if dp % ep:
        raise ConfigError(
            f"actor.megatron.expert_parallel_size = {ep} must divide the data-parallel size {dp} "
            f"(trainer.n_workers = {cfg.trainer.n_workers} / tensor_parallel_size x pipeline_parallel_size = "
            f"{model_parallel}): the experts are split over data-parallel ranks"
        )


def check_megatron_model(cfg: Any) -> None:
    """The model under ``actor.engine=megatron``: no Qwen2-MoE; with EP > 1 a mixture of experts whose
    experts EP divides; a mixture of experts only at ``tensor_parallel_size=1``."""
    if cfg.actor.engine != "megatron":
        return
    from verity.config.sequence_parallel_checks import model_text_config

    options = cfg.actor.megatron
    ep, tp = int(options.expert_parallel_size), int(options.tensor_parallel_size)
    text, _ = model_text_config(cfg, cfg.model.path)
    model_type = getattr(text, "model_type", None)
    if model_type == "qwen2_moe":
        raise ConfigError(
            f"actor.engine=megatron: {cfg.model.path} is a Qwen2-MoE (model_type qwen2_moe), whose sigmoid-gated "
            "shared expert the megatron engine does not convert yet; use actor.engine=fsdp2"
        )
    experts = int(getattr(text, "num_experts", 0) or 0) if model_type == "qwen3_moe" else 0
    if ep > 1 and experts == 0:
        raise ConfigError(
            f"actor.megatron.expert_parallel_size = {ep} needs a mixture-of-experts model, and {cfg.model.path} "
            f"(model_type {model_type}) is dense; set actor.megatron.expert_parallel_size=1"
        )
    if experts and experts % ep:
        raise ConfigError(
            f"actor.megatron.expert_parallel_size = {ep} does not divide the {experts} experts of {cfg.model.path}; "
            "pick a size that divides them"
        )
    if experts and tp > 1:
        raise ConfigError(
            f"actor.megatron.tensor_parallel_size = {tp} with a mixture-of-experts model needs Megatron's sequence "
            "parallelism, which the megatron engine does not run yet; use tensor_parallel_size=1 and "
            "actor.megatron.expert_parallel_size to split the experts"
        )
