"""Start the worker groups of a run's roles (:mod:`verity.workers.registry`) and collect what runs.

    plan = plan_run(cfg, backend)                  # verity.launch.pools: role -> node -> ranks
    groups = start_roles(cfg, inputs, backend, plan)   # pools + groups, every role's init_model() called
    groups.handles["actor"].generate(batch)
    groups.ran                                      # {"actor": {"train_engine": "fsdp2", ...}, ...}
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


@dataclass
class RoleGroups:
    """The running roles: handles by name, their facts (rank 0's), the pools to free."""

    roles: list[RoleDef]
    plan: PlacementPlan = field(default_factory=PlacementPlan)
    handles: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    pools: list[Any] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)

    @property
    def trained(self) -> dict[str, Any]:
        """Handles of the roles that are checkpointed and resumed."""
        return {r.name: self.handles[r.name] for r in self.roles if r.trained}

    def ran(self) -> dict[str, str]:
        """What actually runs, as the workers reported it: ``{"actor": "fsdp2", "rollout": "hf", ...}``."""
        out: dict[str, str] = {}
        for name, facts in self.facts.items():
            if facts.get("train_engine"):
                out[name] = str(facts["train_engine"])
            if facts.get("rollout_engine"):
                out["rollout"] = str(facts["rollout_engine"])
            if facts.get("train_sharding"):
                out[f"{name}_sharding"] = str(facts["train_sharding"])
            if facts.get("train_model_parallel_nodes"):
                out[f"{name}_model_parallel_nodes"] = str(facts["train_model_parallel_nodes"])
            if facts.get("train_compute_dtype"):
                out[f"{name}_compute_dtype"] = str(facts["train_compute_dtype"])
            if facts.get("train_attention"):
                out[f"{name}_attention"] = str(facts["train_attention"])
            if facts.get("train_compiled_layers"):  # only runs that compiled say so
                out[f"{name}_compiled_layers"] = str(facts["train_compiled_layers"])
            if facts.get("train_compiled_head"):
                out[f"{name}_compiled_head"] = "true"
            if facts.get("train_cuda_graphs"):  # only runs that replayed CUDA graphs say so
                out[f"{name}_cuda_graphs"] = "true"
            if facts.get("rollout_dtype"):
                out["rollout_dtype"] = str(facts["rollout_dtype"])
            if facts.get("rollout_attention"):
                out["rollout_attention"] = str(facts["rollout_attention"])
            if facts.get("adapter"):
                out[f"{name}_adapter"] = str(facts["adapter"])
            if facts.get("device_name"):  # the first role's (the actor's): what the run computed on
                out.setdefault("device_name", str(facts["device_name"]))
            if facts.get("rollout_wrappers"):
                out["rollout_wrappers"] = "+".join(str(w) for w in facts["rollout_wrappers"])
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
            facts = out.handles[r.name].init_model()
            out.facts[r.name] = dict(facts[0]) if isinstance(facts, list) and facts else {}
    except BaseException:
        out.close()
        raise
    return out
