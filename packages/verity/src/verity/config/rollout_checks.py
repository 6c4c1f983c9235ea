"""The tensor-parallel rollout's shape (``rollout.tensor_parallel_size``), checked before any worker starts.

A rollout replica is ``tensor_parallel_size`` consecutive ranks: of the actor's workers in
``trainer.mode=sync`` (they regroup into replicas between training stages), of the rollout's own
group in ``async``. It must stay inside one node, split the model's attention and key/value heads
evenly, and be served by an engine that splits the policy (registered with ``tensor_parallel=True``,
:func:`verity.rollout.register_rollout_engine`). The vLLM engine is then one TP rank in each rank's
own process, so its own ``rollout.vllm.tensor_parallel_size`` stays 1 and ``in_process`` is not false.
"""

from __future__ import annotations

import os
from typing import Any

from verity.config.errors import ConfigError

__all__ = ["check_rollout_parallel", "rollout_replica_size"]


def rollout_replica_size(cfg: Any) -> int:
    """Consecutive actor ranks one rollout replica spans in sync mode (1 in async mode: the rollout has its own group)."""
    return int(cfg.rollout.tensor_parallel_size) if cfg.trainer.mode != "async" else 1


def check_rollout_parallel(cfg: Any) -> None:
    """``rollout.tensor_parallel_size``: an engine that splits the policy, whole replicas per node, even heads."""
    tp = int(cfg.rollout.tensor_parallel_size)
    if tp == 1:
        return
    from verity.rollout.registry import ROLLOUT_ENGINES

    engine = cfg.rollout.engine
    spec = ROLLOUT_ENGINES.get(engine)
    if not spec.tensor_parallel:
        able = sorted(name for name, s in ROLLOUT_ENGINES.items() if s.tensor_parallel)
        raise ConfigError(
            f"rollout.tensor_parallel_size = {tp}: the {engine!r} rollout engine does not split the policy "
            f"over the actor's ranks; use rollout.engine={' or '.join(able) or 'hf'} or tensor_parallel_size=1"
        )
    if cfg.trainer.mode == "async" and engine != "hf":
        raise ConfigError(
            f"rollout.tensor_parallel_size = {tp} with trainer.mode=async: the rollout group's replicas run the "
            f"hf engine only (the {engine!r} engine splits the actor's ranks in sync mode); use rollout.engine=hf "
            "or trainer.mode=sync"
        )
    _check_engine_options(cfg, tp)
    _check_replicas_fit_nodes(cfg, tp)
    _check_heads(cfg, tp)


def _check_engine_options(cfg: Any, tp: int) -> None:
    """vLLM's replica runs in the ranks' own processes, one TP rank each (its external launcher)."""
    if cfg.rollout.engine != "vllm":
        return
    options = cfg.rollout.vllm
    if int(options.tensor_parallel_size) > 1:
        raise ConfigError(
            f"rollout.vllm.tensor_parallel_size = {options.tensor_parallel_size} with rollout.tensor_parallel_size "
            f"= {tp}: the vLLM engine already spans its replica's {tp} ranks, one TP rank in each; "
            "leave rollout.vllm.tensor_parallel_size at 1"
        )
    if options.in_process is False:
        raise ConfigError(
            f"rollout.vllm.in_process = false with rollout.tensor_parallel_size = {tp}: the tensor-parallel vLLM "
            "engine runs inside the ranks' own processes; leave rollout.vllm.in_process null"
        )


def _check_replicas_fit_nodes(cfg: Any, tp: int) -> None:
    from verity.config.cluster_checks import actor_workers_per_node

    if cfg.trainer.mode == "async":
        workers, key = cfg.rollout.n_workers, "rollout.n_workers"
        per_node = workers // cfg.rollout.nnodes if cfg.rollout.nnodes else workers
    else:
        workers, key = cfg.trainer.n_workers, "trainer.n_workers"
        per_node = actor_workers_per_node(cfg)
    if workers % tp:
        raise ConfigError(
            f"{key} = {workers} is not a multiple of rollout.tensor_parallel_size = {tp}: "
            "every rollout replica needs that many ranks"
        )
    if per_node is not None and per_node % tp:
        raise ConfigError(
            f"{per_node} workers per node ({key}) is not a multiple of rollout.tensor_parallel_size = {tp}: "
            "a rollout replica must stay inside one node"
        )


def _check_heads(cfg: Any, tp: int) -> None:
    if cfg.model.path == "embedded":  # the preset's shape: a fresh model, built in memory
        from verity.data.embedded import embedded_preset

        model = embedded_preset(cfg.model.embedded_preset).fresh_model(cfg.trainer.seed)[0].config
    else:
        from transformers import AutoConfig

        model = AutoConfig.from_pretrained(os.path.expanduser(cfg.model.path), local_files_only=True)
    text = model.get_text_config() if hasattr(model, "get_text_config") else model
    if text is not model:
        raise ConfigError(
            f"rollout.tensor_parallel_size = {tp}: the tensor-parallel rollout serves text-only models, and "
            f"{cfg.model.path} has a vision tower; use rollout.tensor_parallel_size=1"
        )
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % tp or kv_heads % tp:
        raise ConfigError(
            f"rollout.tensor_parallel_size = {tp} does not divide the model's {heads} attention heads and "
            f"{kv_heads} key/value heads ({cfg.model.path}); pick a size that divides both"
        )
