"""The stage plan of a run: the built-in stages, edited by plug-ins' stage planners.

The one RL loop runs a list of :class:`~verity.trainer.stages.Stage`. The built-in
list comes from the config (:func:`~verity.trainer.stages.default_stages`); then
every registered *stage planner* may edit it through a :class:`StagePlan`::

    def demo_planner(cfg, plan: StagePlan) -> None:
        if cfg.demo.enabled:                                   # the plug-in's config section
            plan.insert_after("reward", Stage("demo_bonus", demo_bonus))

    register_stage_planner("demo", demo_planner, after=("prime",))

A planner can insert a stage before or after a named one, replace one, remove one, or
wrap a run of stages into one stage that runs them (:meth:`StagePlan.wrap`: DAPO's
dynamic sampling repeats generation and scoring); it reads the config to decide, so a
plug-in that is installed but switched off changes nothing.

Planners run in a declared order, never by name: ``after=`` / ``before=`` name the
planners this one must follow or precede (names not installed are ignored), otherwise
they run in the order they were registered. A planner may replace or remove only the
built-in stages and its own: a stage another planner added is that planner's, and
touching it fails at start naming both (a planner that needs it runs it inside a
:meth:`StagePlan.wrap`, where the printed plan still shows it:
``dynamic_sampling[generate, reward, prime_filter]``). Every built-in stage function is also registered by name in
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
    "planner_order",
    "register_stage",
    "register_stage_planner",
]

StagePlanner = Callable[[Any, "StagePlan"], None]

STAGES: Registry[StageFn] = Registry("stage")
STAGE_PLANNERS: Registry[StagePlanner] = Registry("stage planner")
#: each planner's ``(after, before)``: the planners it must run after / before
_PLANNER_ORDER: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
BUILT_IN = "built-in"


class StagePlanError(ValueError):
    """A planner asked for a stage that is not in the plan, or added a name twice."""


def register_stage(name: str, fn: StageFn) -> None:
    """Make the stage function ``fn`` available by ``name`` (for planners to reuse)."""
    STAGES.add(name, fn)


def register_stage_planner(
    name: str, planner: StagePlanner, *, after: tuple[str, ...] = (), before: tuple[str, ...] = ()
) -> None:
    """Add a planner ``planner(cfg, plan)`` that edits every run's stage plan (see the module docstring).

    ``after`` / ``before``: planners this one must run after / before, by name.
    """
    STAGE_PLANNERS.add(name, planner)
    _PLANNER_ORDER[name] = (tuple(after), tuple(before))


def planner_order() -> list[str]:
    """The registered planners in the order they run: declared ``after``/``before`` first, then registration order."""
    registered = {name for name, _ in STAGE_PLANNERS.items()}
    names = [name for name in _PLANNER_ORDER if name in registered]  # registration order (the registry sorts)
    names += sorted(registered - set(names))  # added to the registry directly
    position = {name: i for i, name in enumerate(names)}
    must_follow: dict[str, set[str]] = {name: set() for name in names}
    for name in names:
        after, before = _PLANNER_ORDER.get(name, ((), ()))
        must_follow[name] |= {other for other in after if other in position}
        for other in before:
            if other in position:
                must_follow[other].add(name)
    ordered: list[str] = []
    while len(ordered) < len(names):
        ready = [n for n in names if n not in ordered and must_follow[n] <= set(ordered)]
        if not ready:
            stuck = sorted(n for n in names if n not in ordered)
            raise StagePlanError(f"stage planners {stuck} declare an order that goes round in a circle (after=/before=)")
        ordered.append(min(ready, key=position.__getitem__))
    return ordered


class StagePlan:
    """An ordered list of stages with unique names, edited by name."""

    def __init__(self, stages: list[Stage]) -> None:
        self._stages: list[Stage] = []
        self._held: dict[str, str] = {}  # stage name -> why no later edit may replace or remove it
        self._owner: dict[str, str] = {}  # stage name -> the planner that added it (BUILT_IN: the defaults)
        self._inner: dict[str, list[str]] = {}  # a wrapping stage's name -> the stages it runs
        self.planner = BUILT_IN  # who is editing now (set by build_stage_plan)
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
        owner = self._owner.get(name, BUILT_IN)
        if owner not in (BUILT_IN, self.planner):
            raise StagePlanError(
                f"stage {name!r} was added by stage planner {owner!r}: another planner may not replace or "
                "remove it (run it inside StagePlan.wrap, or order the planners with after=/before=)"
            )

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
        self._owner[stage.name] = self.planner

    def insert_before(self, name: str, stage: Stage) -> None:
        """Add ``stage`` just before the stage called ``name``."""
        self._check_new(stage)
        self._stages.insert(self._index(name), stage)
        self._owner[stage.name] = self.planner

    def insert_after(self, name: str, stage: Stage) -> None:
        """Add ``stage`` just after the stage called ``name``."""
        self._check_new(stage)
        self._stages.insert(self._index(name) + 1, stage)
        self._owner[stage.name] = self.planner

    def wrap(self, first: str, last: str, build: Callable[[list[Stage]], Stage]) -> None:
        """Put one stage, ``build(stages)``, in the place of the run ``first`` .. ``last`` (inclusive).

        The new stage runs the wrapped ones itself (say, once per sampling round); they stay
        named in :meth:`describe` as ``name[first, ..., last]``. A held stage cannot be wrapped.
        """
        start, stop = self._index(first), self._index(last)
        if stop < start:
            raise StagePlanError(f"wrap: {last!r} comes before {first!r} in the plan")
        span = self._stages[start : stop + 1]
        for stage in span:
            if stage.name in self._held:
                raise StagePlanError(f"stage {stage.name!r} cannot be wrapped: {self._held[stage.name]}")
        outer = build(list(span))
        names = [s.name for s in span]
        if outer.name in self and outer.name not in names:
            raise StagePlanError(f"the plan already has a stage {outer.name!r}")
        inner = [n for s in span for n in self._inner.get(s.name, [s.name])]
        self._stages[start : stop + 1] = [outer]
        self._inner[outer.name] = inner
        self._owner[outer.name] = self.planner

    def replace(self, name: str, stage: Stage) -> None:
        """Put ``stage`` in the place of the stage called ``name`` (it may keep the name)."""
        index = self._index(name)
        self._check_not_held(name)
        if stage.name != name and stage.name in self:
            raise StagePlanError(f"the plan already has a stage {stage.name!r}")
        self._stages[index] = stage
        self._owner[stage.name] = self.planner

    def remove(self, name: str) -> None:
        """Drop the stage called ``name``."""
        index = self._index(name)
        self._check_not_held(name)
        del self._stages[index]

    def describe(self) -> str:
        """``generate -> reward -> ...``, the form printed at start and logged; a wrapping stage with what it runs."""
        return " -> ".join(
            f"{name}[{', '.join(self._inner[name])}]" if name in self._inner else name for name in self.names()
        )


def build_stage_plan(cfg: Any) -> StagePlan:
    """The built-in stages for ``cfg``, then every registered planner's edits, in :func:`planner_order`."""
    plan = StagePlan(builtin.default_stages(cfg))
    for name in planner_order():
        plan.planner = name
        try:
            STAGE_PLANNERS.get(name)(cfg, plan)
        except StagePlanError as err:
            raise StagePlanError(f"stage planner {name!r}: {err}") from None
    plan.planner = BUILT_IN
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
