"""Start the worker groups of a run's roles (:mod:`verity.workers.registry`) and collect what runs.

    plan = plan_run(cfg, backend)                  # verity.launch.pools: role -> node -> ranks
    groups = start_roles(cfg, inputs, backend, plan)   # pools + groups, every role's init_model() called
    groups.handles["actor"].generate(batch)
    groups.ran()                                    # {"actor": "fsdp2", "rollout": "hf", ...}
    groups.close()                                  # kill the workers, free the pools

Colocated roles share one worker group on the actor's pool (``trainer.n_workers``
slots over ``trainer.nnodes`` nodes); each ``separate`` role gets a pool and group of its
own. Every pool is reserved where the placement plan put it, one placement group per node.
Roles start in registry order (the actor first: it forms the process group the colocated
roles join).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from verity.controller.placement import PlacementPlan, PoolPlacement, placement_record
from verity.launch.pools import ACTOR_POOL, plan_run
from verity.trainer import async_rollout as _async_rollout  # noqa: F401 (registers the async rollout role)
from verity.workers.registry import RoleDef, RoleInputs, enabled_roles, role_placement
from verity.workers.report import WorkerReport


@dataclass
class RoleGroups:
    """The running roles: handles by name, their reports (rank 0's), the pools to free."""

    roles: list[RoleDef]
    plan: PlacementPlan = field(default_factory=PlacementPlan)
    handles: dict[str, Any] = field(default_factory=dict)
    reports: dict[str, WorkerReport] = field(default_factory=dict)
    pools: list[Any] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)

    @property
    def trained(self) -> dict[str, Any]:
        """Handles of the roles that are checkpointed and resumed."""
        return {r.name: self.handles[r.name] for r in self.roles if r.trained}

    def ran(self) -> dict[str, str]:
        """What actually runs, as the workers reported it: ``{"actor": "fsdp2", "rollout": "hf", ...}``
        (:meth:`~verity.workers.report.WorkerReport.ran` of each role), the device the first role
        (the actor) computed on, the trainer mode and where every pool's ranks ran."""
        out: dict[str, str] = {}
        for name, report in self.reports.items():
            out.update(report.ran(name))
            if report.device_name:
                out.setdefault("device_name", report.device_name)
        # trainer.mode as it ran: a rollout worker group of its own is what generates one step ahead
        out["mode"] = "async" if "rollout" in self.handles else "sync"
        out.update(self.placement())
        return out

    def placement(self) -> dict[str, str]:
        """Where every pool's ranks ran, from the reserved placement groups (``{"placement.actor": "ip/node:0-1", ...}``)."""
        if not self.pools:
            return {}
        return placement_record({pool.name: pool.slot_node_ids for pool in self.pools}, self.plan.nodes)

    def close(self) -> None:
        """Kill every worker and free every pool (safe to call twice)."""
        for group in self.groups:
            with contextlib.suppress(Exception):
                group.shutdown()
        for pool in self.pools:
            with contextlib.suppress(Exception):
                pool.remove()
        self.groups, self.pools = [], []


def cpus_needed(cfg: Any) -> float:
    """Ray CPUs the run's pools reserve: the actor's pool plus every separate role's."""
    total = cfg.trainer.n_workers * cfg.trainer.cpus_per_worker
    for role in enabled_roles(cfg):
        placement, n_workers = role_placement(role, cfg)
        if placement == "separate":
            total += n_workers * cfg.trainer.cpus_per_worker
    return total


def _pool(cfg: Any, backend: Any, placed: PoolPlacement) -> Any:
    """The reservation of one planned pool: a placement group on each of its nodes."""
    from verity.controller import ResourcePool

    return ResourcePool.from_plan(
        placed,
        resource=backend.ray_resource,
        cpus_per_bundle=cfg.trainer.cpus_per_worker,
        timeout_s=cfg.trainer.placement_timeout_s,
    )


def _handle(role: RoleDef, cfg: Any, group: Any) -> Any:
    """What the driver holds for ``role``: its ``handle`` factory's object, or the group (view) itself."""
    return role.handle(cfg, group) if role.handle is not None else group


def worker_env(cfg: Any) -> dict[str, str]:
    """What every worker of the run is told: its log folder (:mod:`verity.controller.worker_logs`) and a CPU run."""
    from pathlib import Path

    from verity.controller.worker_logs import LOG_DIR_ENV

    env = {LOG_DIR_ENV: str(Path(cfg.trainer.output_dir).expanduser().resolve() / "logs")}
    if cfg.trainer.device == "cpu":
        env["VERITY_WORKER_DEVICE"] = "cpu"
    return env


def start_roles(cfg: Any, inputs: RoleInputs, backend: Any, plan: PlacementPlan | None = None) -> RoleGroups:
    """Reserve the pools of ``plan`` (default: :func:`plan_run`), start every enabled role's worker group,
    call each role's ``init_model``."""
    from verity.controller import WorkerGroup, colocate, role

    roles = enabled_roles(cfg)
    out = RoleGroups(roles, plan if plan is not None else plan_run(cfg, backend))
    try:
        colocated = [r for r in roles if role_placement(r, cfg)[0] == "colocated"]
        separate = [r for r in roles if role_placement(r, cfg)[0] == "separate"]
        pool = _pool(cfg, backend, out.plan.pool(ACTOR_POOL))
        out.pools.append(pool)
        if len(colocated) == 1:
            only = colocated[0]
            group = WorkerGroup(
                pool, only.worker, *only.args(cfg, inputs), name=only.name, env_vars=worker_env(cfg)
            )
            out.handles[only.name] = _handle(only, cfg, group)
        else:
            specs = {r.name: role(r.worker, *r.args(cfg, inputs)) for r in colocated}
            group = WorkerGroup(pool, colocate(specs), name="+".join(specs), env_vars=worker_env(cfg))
            by_name = {r.name: r for r in colocated}
            out.handles.update({name: _handle(by_name[name], cfg, getattr(group, name)) for name in specs})
        out.groups.append(group)
        for r in separate:
            own_pool = _pool(cfg, backend, out.plan.pool(r.name))
            out.pools.append(own_pool)
            own = WorkerGroup(own_pool, r.worker, *r.args(cfg, inputs), name=r.name, env_vars=worker_env(cfg))
            out.groups.append(own)
            out.handles[r.name] = _handle(r, cfg, own)
        for r in roles:
            answers = out.handles[r.name].init_model()
            out.reports[r.name] = WorkerReport.from_answer(answers[0] if isinstance(answers, list) else answers)
    except BaseException:
        out.close()
        raise
    return out
