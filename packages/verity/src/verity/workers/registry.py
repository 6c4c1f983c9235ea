"""Roles by name: the worker groups a run builds, and where each runs.

A role is a :class:`~verity.controller.Worker` subclass plus a rule saying when a run
needs it. The trainer builds every enabled role (:func:`enabled_roles`): those placed
``colocated`` share the actor's processes (one colocated worker group, one process
per rank: the same device, the same ``torch.distributed`` group), each ``separate``
one gets its own resource pool and worker group. A plug-in adds a role the same way
the built-in ones are added::

    register_role(RoleDef(
        "prm", PRMWorker,
        enabled=lambda cfg: cfg.prime.enabled,
        args=lambda cfg, inputs: (cfg, inputs.model_path),
        section="prime",          # cfg.prime.placement / cfg.prime.n_workers
        trained=True,             # checkpointed, resumed and exportable like the actor
    ))

Every role class offers ``init_model()`` (broadcast; returns one dict of facts per
rank), and a trained role ``save_checkpoint(path)`` / ``load_checkpoint(path)``.
The driver reaches a role's methods as ``ctx.roles["prm"].update(batch)``.

Built in: ``actor`` (actor + rollout + reference, always), ``critic`` (when the
estimator needs values or ``critic.enabled``), ``reward_model`` (``reward_model.enabled``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verity.registry import Registry

__all__ = ["ROLES", "RoleDef", "RoleInputs", "enabled_roles", "register_role", "role_placement"]


@dataclass(frozen=True)
class RoleInputs:
    """Local paths every role may read: the policy checkpoint and its tokenizer."""

    model_path: str
    tokenizer_path: str


def _default_args(cfg: Any, inputs: RoleInputs) -> tuple:
    return (cfg, inputs.model_path, inputs.tokenizer_path)


@dataclass(frozen=True)
class RoleDef:
    """One role: its worker class, when a run needs it, how it is built and placed.

    Attributes:
        name: the role's name (``ctx.roles[name]``, its checkpoint folder).
        worker: a ``verity.controller.Worker`` subclass.
        enabled: ``cfg -> bool``, whether this run builds the role.
        args: ``(cfg, RoleInputs) -> tuple``, the worker's constructor arguments.
        section: the config section holding ``placement`` (``colocated`` | ``separate``)
            and ``n_workers``; ``None``: always colocated with the actor.
        trained: saved in every checkpoint and restored on resume.
        order: build order among colocated roles (lower first; the actor is 0 and
            forms the process group the others join).
        placement: ``cfg -> (placement, n_workers)``, overriding ``section`` (a role whose
            placement follows from other keys, e.g. the async rollout: always ``separate``).
        handle: ``(cfg, worker group) -> handle``: what the driver holds for the role instead of
            the bare group (a driver-side object with state across steps); it must offer
            ``init_model()`` and, when ``trained``, ``save_checkpoint`` / ``load_checkpoint``,
            and expose the group as ``.group``.
    """

    name: str
    worker: type
    enabled: Callable[[Any], bool]
    args: Callable[[Any, RoleInputs], tuple] = _default_args
    section: str | None = None
    trained: bool = False
    order: int = 100
    placement: Callable[[Any], tuple[str, int]] | None = None
    handle: Callable[[Any, Any], Any] | None = None


ROLES: Registry[RoleDef] = Registry("role")


def register_role(role: RoleDef) -> None:
    """Add ``role`` to the registry (a name may be registered once)."""
    from verity.controller import Worker

    if not (isinstance(role.worker, type) and issubclass(role.worker, Worker)):
        raise TypeError(f"role {role.name!r}: worker must be a verity.controller.Worker subclass")
    ROLES.add(role.name, role)


def role_placement(role: RoleDef, cfg: Any) -> tuple[str, int]:
    """``(placement, n_workers)`` of ``role`` in this run (``colocated`` roles use ``trainer.n_workers``)."""
    if role.placement is not None:
        placement, n_workers = role.placement(cfg)
        return placement, int(n_workers)
    section = getattr(cfg, role.section) if role.section else None
    placement = getattr(section, "placement", "colocated") if section is not None else "colocated"
    n_workers = getattr(section, "n_workers", None) if section is not None else None
    if role.name == "actor":
        placement = "colocated"
    return placement, int(n_workers or cfg.trainer.n_workers)


def enabled_roles(cfg: Any) -> list[RoleDef]:
    """The roles this run builds, the actor first, then by ``order`` and name."""
    roles = [role for _, role in ROLES.items() if role.enabled(cfg)]
    return sorted(roles, key=lambda r: (r.name != "actor", r.order, r.name))


def _register_builtin_roles() -> None:
    from verity.config.derived import needs_critic
    from verity.workers.actor_rollout import ActorRolloutRefWorker
    from verity.workers.critic import CriticWorker
    from verity.workers.reward_model import RewardModelWorker

    register_role(RoleDef("actor", ActorRolloutRefWorker, enabled=lambda cfg: True, trained=True, order=0))
    register_role(
        RoleDef(
            "critic",
            CriticWorker,
            enabled=needs_critic,
            args=lambda cfg, inputs: (cfg, inputs.model_path),
            section="critic",
            trained=True,
            order=10,
        )
    )
    register_role(
        RoleDef(
            "reward_model",
            RewardModelWorker,
            enabled=lambda cfg: bool(cfg.reward_model.enabled),
            args=lambda cfg, inputs: RewardModelWorker.args_from_config(cfg),
            section="reward_model",
            order=20,
        )
    )


_register_builtin_roles()
