"""The run's cluster shape: ``trainer.nnodes`` x ``trainer.n_workers_per_node`` = ``trainer.n_workers``,
and each separate role's ``nnodes``; derived where the user left a key unset, checked before Ray starts.

Only what the config alone can tell is checked here (sizes, divisibility, a multi-node shape without a
cluster to join). Whether the cluster holds the shape is the placement plan's question
(:mod:`verity.launch.pools`), answered after Ray is joined and before any worker starts.
"""

from __future__ import annotations

import math
import os
from typing import Any

from verity.config.errors import ConfigError

__all__ = ["apply_cluster_shape", "cluster_address", "model_parallel_size", "validate_cluster_shape"]

#: the variable Ray reads when ``ray.init()`` gets no address; ``ray job submit`` sets it for its entrypoint
RAY_ADDRESS_VARIABLE = "RAY_ADDRESS"


def cluster_address(cfg: Any) -> str | None:
    """The Ray cluster the run joins: ``trainer.ray_address``, else ``$RAY_ADDRESS`` (set by ``ray job submit``
    for its entrypoint, and by users who point their shell at a cluster), else ``None``: a private cluster."""
    return cfg.trainer.ray_address or os.environ.get(RAY_ADDRESS_VARIABLE) or None


def apply_cluster_shape(cfg: Any, explicit: set[str]) -> None:
    """Derive ``trainer.n_workers`` (the total) from ``nnodes x n_workers_per_node`` when the user set both
    and left ``n_workers`` unset; a given ``n_workers`` is checked against them in :func:`validate_cluster_shape`."""
    t = cfg.trainer
    both = t.nnodes is not None and t.n_workers_per_node is not None
    if both and "trainer.n_workers" not in explicit and t.nnodes >= 1 and t.n_workers_per_node >= 1:
        t.n_workers = t.nnodes * t.n_workers_per_node


def model_parallel_size(cfg: Any) -> int:
    """Consecutive actor ranks that must share a node: Megatron's TP x PP group (1 for FSDP2), in
    sync mode the tensor-parallel rollout replica (``rollout.tensor_parallel_size``), and the FSDP2
    sequence-parallel groups of the actor and of a colocated critic
    (``fsdp2.ulysses_sequence_parallel_size``), Megatron's expert-parallel group (EP x TP); the least
    common multiple of them."""
    from verity.config.megatron_checks import expert_group_size
    from verity.config.rollout_checks import rollout_replica_size

    return math.lcm(
        _megatron_group(cfg), rollout_replica_size(cfg), _sequence_parallel_group(cfg), expert_group_size(cfg)
    )


def _sequence_parallel_group(cfg: Any) -> int:
    """The actor's SP size and a colocated critic's, as their lcm (1 where the FSDP2 engine does not split)."""
    from verity.config.derived import needs_critic

    sizes = [int(cfg.actor.fsdp2.ulysses_sequence_parallel_size) if cfg.actor.engine == "fsdp2" else 1]
    if needs_critic(cfg) and cfg.critic.placement == "colocated" and cfg.critic.engine == "fsdp2":
        sizes.append(int(cfg.critic.fsdp2.ulysses_sequence_parallel_size))
    return math.lcm(*sizes)


def _megatron_group(cfg: Any) -> int:
    """Megatron's TP x PP (1 for another engine)."""
    if cfg.actor.engine != "megatron":
        return 1
    options = cfg.actor.megatron
    return int(options.tensor_parallel_size) * int(options.pipeline_parallel_size)


def validate_cluster_shape(cfg: Any) -> None:
    """``trainer.nnodes`` / ``n_workers_per_node`` / ``placement_timeout_s`` and every role's ``nnodes``."""
    t = cfg.trainer
    for key in ("nnodes", "n_workers_per_node"):
        value = getattr(t, key)
        if value is not None and value < 1:
            raise ConfigError(
                f"trainer.{key} must be >= 1 (or null: chosen from trainer.n_workers), got {value}"
            )
    if (
        t.nnodes is not None
        and t.n_workers_per_node is not None
        and t.nnodes * t.n_workers_per_node != t.n_workers
    ):
        raise ConfigError(
            f"trainer.n_workers = {t.n_workers} is the total over all nodes, but trainer.nnodes x "
            f"trainer.n_workers_per_node = {t.nnodes} x {t.n_workers_per_node} = {t.nnodes * t.n_workers_per_node}; "
            "leave trainer.n_workers unset (it is derived) or make the three agree"
        )
    for key in ("nnodes", "n_workers_per_node"):
        value = getattr(t, key)
        if value is not None and t.n_workers % value:
            raise ConfigError(
                f"trainer.n_workers = {t.n_workers} does not divide over trainer.{key} = {value}"
            )
    group = _megatron_group(cfg)  # the rollout's replicas: verity.config.rollout_checks
    per_node = actor_workers_per_node(cfg)
    # a total that is not a multiple of the group is the megatron checks' to name (validate.py)
    if group > 1 and per_node is not None and per_node % group and not t.n_workers % group:
        raise ConfigError(
            f"{per_node} actor workers per node is not a multiple of actor.megatron.tensor_parallel_size x "
            f"pipeline_parallel_size = {group}: a model-parallel group must stay inside one node"
        )
    _check_expert_group_in_node(cfg, per_node)
    sections = {"critic": cfg.critic, "reward_model": cfg.reward_model}
    for name, section in sections.items():
        validate_role_nnodes(name, section.placement, section.n_workers or t.n_workers, section.nnodes)
    async_mode = t.mode == "async"
    if cfg.rollout.nnodes is not None:
        validate_role_nnodes(
            "rollout", "separate" if async_mode else "colocated", cfg.rollout.n_workers, cfg.rollout.nnodes
        )
    asked = {"trainer": t.nnodes, "rollout": cfg.rollout.nnodes, **{k: s.nnodes for k, s in sections.items()}}
    multi_node = [f"{key}.nnodes={value}" for key, value in asked.items() if (value or 1) > 1]
    if multi_node and cluster_address(cfg) is None:
        raise ConfigError(
            f"{', '.join(multi_node)} spans several nodes, which needs a Ray cluster to join: set "
            "trainer.ray_address (auto on a node of the cluster; docs/multi-node.md) or RAY_ADDRESS; without either verity starts "
            "a private cluster of this machine alone"
        )


def _check_expert_group_in_node(cfg: Any, per_node: int | None) -> None:
    """An expert-parallel group's all-to-all stays on one node's fast links (EP x TP consecutive ranks)."""
    from verity.config.megatron_checks import expert_group_size

    group = expert_group_size(cfg)
    if group > 1 and per_node is not None and per_node % group and not cfg.trainer.n_workers % group:
        raise ConfigError(
            f"{per_node} actor workers per node is not a multiple of actor.megatron.expert_parallel_size x "
            f"tensor_parallel_size = {group}: an expert-parallel group's token all-to-all must stay inside one node"
        )


def actor_workers_per_node(cfg: Any) -> int | None:
    """Actor workers on each node when the config fixes it (``None``: the placement plan chooses)."""
    t = cfg.trainer
    if t.n_workers_per_node is not None:
        return t.n_workers_per_node
    if t.nnodes is not None:
        return t.n_workers // t.nnodes
    return t.n_workers if cluster_address(cfg) is None else None


def validate_role_nnodes(section: str, placement: str, n_workers: int, nnodes: int | None) -> None:
    """A role section's ``nnodes``: only with ``placement=separate``, dividing its ``n_workers``."""
    if nnodes is None:
        return
    if placement != "separate":
        raise ConfigError(
            f"{section}.nnodes = {nnodes} applies only to placement=separate; a colocated role runs in the "
            "actor's processes, on the actor's nodes (trainer.nnodes)"
        )
    if nnodes < 1 or n_workers % nnodes:
        raise ConfigError(
            f"{section}.nnodes = {nnodes}: the group's {n_workers} workers must divide over its nodes (nnodes >= 1)"
        )
