"""The stage plan of a run: the built-in stages, edited by plug-ins' stage planners.

The one RL loop runs a list of :class:`~verity.trainer.stages.Stage`. The built-in
list comes from the config (:func:`~verity.trainer.stages.default_stages`); then
every registered *stage planner* may edit it, in name order, through a
:class:`StagePlan`::

    def demo_planner(cfg, plan: StagePlan) -> None:
        if cfg.demo.enabled:                                   # the plug-in's config section
            plan.insert_after("reward", Stage("demo_bonus", demo_bonus))

    register_stage_planner("demo", demo_planner)

A planner can insert a stage before or after a named one, replace one, or remove
one; it reads the config to decide, so a plug-in that is installed but switched off
changes nothing. Every built-in stage function is also registered by name in
:data:`STAGES`, so a planner can reuse one. The plan a run uses is printed when it
starts and logged to MLflow (``trainer.stage_plan``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verity.registry import Registry
from verity.trainer import stages as builtin
from verity.trainer.stages import Stage, StageFn

__all__ = [
    "STAGES",
    "STAGE_PLANNERS",
    "StagePlan",
    "StagePlanError",
    "build_stage_plan",
    "register_stage",
    "register_stage_planner",
]

StagePlanner = Callable[[Any, "StagePlan"], None]

STAGES: Registry[StageFn] = Registry("stage")
STAGE_PLANNERS: Registry[StagePlanner] = Registry("stage planner")


class StagePlanError(ValueError):
    """A planner asked for a stage that is not in the plan, or added a name twice."""


def register_stage(name: str, fn: StageFn) -> None:
    """Make the stage function ``fn`` available by ``name`` (for planners to reuse)."""
    STAGES.add(name, fn)


def register_stage_planner(name: str, planner: StagePlanner) -> None:
    """Add a planner ``planner(cfg, plan)`` that edits every run's stage plan (see the module docstring)."""
    STAGE_PLANNERS.add(name, planner)


class StagePlan:
    """An ordered list of stages with unique names, edited by name."""

    def __init__(self, stages: list[Stage]) -> None:
        self._stages: list[Stage] = []
        self._held: dict[str, str] = {}  # stage name -> why no later edit may replace or remove it
        for stage in stages:
            self.append(stage)

    def hold(self, name: str, reason: str) -> None:
        """Keep the stage called ``name`` as it is: a later ``replace``/``remove`` of it raises, giving ``reason``.

        A planner whose run depends on its own version of a stage (``trainer.mode=async``
        on its ``generate``) holds it, so that a second planner wanting the same stage
        fails at start naming both instead of silently winning.
        """
        self._index(name)
        self._held[name] = reason

    def _check_not_held(self, name: str) -> None:
        if name in self._held:
            raise StagePlanError(f"stage {name!r} cannot be replaced or removed: {self._held[name]}")

    @property
    def stages(self) -> list[Stage]:
        """The stages in order (a copy)."""
        return list(self._stages)

    def names(self) -> list[str]:
        """The stage names in order."""
        return [s.name for s in self._stages]

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def _index(self, name: str) -> int:
        names = self.names()
        if name not in names:
            raise StagePlanError(f"no stage {name!r} in the plan; stages: {' -> '.join(names)}")
        return names.index(name)

    def _check_new(self, stage: Stage) -> None:
        if not isinstance(stage, Stage):
            raise TypeError(f"expected a Stage, got {type(stage).__name__}")
        if stage.name in self:
            raise StagePlanError(f"the plan already has a stage {stage.name!r}; replace it instead")

    def append(self, stage: Stage) -> None:
        """Add ``stage`` at the end."""
        self._check_new(stage)
        self._stages.append(stage)

    def insert_before(self, name: str, stage: Stage) -> None:
        """Add ``stage`` just before the stage called ``name``."""
        self._check_new(stage)
        self._stages.insert(self._index(name), stage)

    def insert_after(self, name: str, stage: Stage) -> None:
        """Add ``stage`` just after the stage called ``name``."""
        self._check_new(stage)
        self._stages.insert(self._index(name) + 1, stage)

    def replace(self, name: str, stage: Stage) -> None:
        """Put ``stage`` in the place of the stage called ``name`` (it may keep the name)."""
        index = self._index(name)
        self._check_not_held(name)
        if stage.name != name and stage.name in self:
            raise StagePlanError(f"the plan already has a stage {stage.name!r}")
        self._stages[index] = stage

    def remove(self, name: str) -> None:
        """Drop the stage called ``name``."""
        index = self._index(name)
        self._check_not_held(name)
        del self._stages[index]

    def describe(self) -> str:
        """``generate -> reward -> ...``, the form printed at start and logged."""
        return " -> ".join(self.names())


def build_stage_plan(cfg: Any) -> StagePlan:
    """The built-in stages for ``cfg``, then every registered planner's edits, in planner-name order."""
    plan = StagePlan(builtin.default_stages(cfg))
    for name, planner in STAGE_PLANNERS.items():
        try:
            planner(cfg, plan)
        except StagePlanError as err:
            raise StagePlanError(f"stage planner {name!r}: {err}") from None
    return plan


for _name, _fn in (
    ("generate_baseline", builtin.generate_baseline),
    ("generate", builtin.generate),
    ("agent_metrics", builtin.agent_metrics),
    ("reward", builtin.reward),
    ("reward_model", builtin.reward_model_score),
    ("old_log_prob", builtin.old_log_prob),
    ("ref_log_prob", builtin.ref_log_prob),
    ("values", builtin.values),
    ("advantage", builtin.advantage),
    ("update_critic", builtin.update_critic),
    ("update_actor", builtin.update_actor),
):
    register_stage(_name, _fn)


def _register_async() -> None:
    from verity.trainer import async_rollout

    register_stage("rollout_sync", async_rollout.rollout_sync)
    register_stage_planner("async", async_rollout.plan_async)


_register_async()
