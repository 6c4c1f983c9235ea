"""Stage planners compose: a declared order, no planner touching another's stages, wrapped stages stay visible."""

from __future__ import annotations

import pytest
from verity.config import load_config
from verity.registry import Registry
from verity.trainer import stage_plan
from verity.trainer.stage_plan import StagePlan, StagePlanError, build_stage_plan, planner_order
from verity.trainer.stages import Stage


def _noop(ctx, batch):
    return batch


@pytest.fixture
def planners(monkeypatch):
    """A private planner registry: ``add(name, fn, after=..., before=...)`` registers into it."""
    load_config([])  # the installed plug-ins register their planners into the real registry first (once a process)
    monkeypatch.setattr(stage_plan, "STAGE_PLANNERS", Registry("stage planner"))
    monkeypatch.setattr(stage_plan, "_PLANNER_ORDER", {})
    return stage_plan.register_stage_planner


def test_planners_run_in_declared_order_then_registration_order_never_by_name(planners):
    planners("zeta", lambda cfg, plan: None)
    planners("alpha", lambda cfg, plan: None, after=("mid",))
    planners("mid", lambda cfg, plan: None, before=("zeta",), after=("not-installed",))
    assert planner_order() == ["mid", "zeta", "alpha"]
    planners("loop", lambda cfg, plan: None, after=("loop2",))
    planners("loop2", lambda cfg, plan: None, after=("loop",))
    with pytest.raises(
        StagePlanError, match=r"\['loop', 'loop2'\] declare an order that goes round in a circle"
    ):
        planner_order()


def test_a_planner_may_not_remove_or_replace_a_stage_another_planner_added(planners):
    planners("adds", lambda cfg, plan: plan.insert_after("reward", Stage("bonus", _noop)))
    planners("drops", lambda cfg, plan: plan.remove("bonus"))
    with pytest.raises(
        StagePlanError, match=r"stage planner 'drops': stage 'bonus' was added by stage planner 'adds'"
    ):
        build_stage_plan(load_config([]))


def test_a_wrapped_run_of_stages_is_shown_inside_its_wrapper():
    plan = StagePlan([Stage(n, _noop) for n in ("generate", "reward", "old_log_prob", "update_actor")])
    plan.wrap("generate", "reward", lambda span: Stage("rounds", _noop))
    assert plan.names() == ["rounds", "old_log_prob", "update_actor"]
    assert plan.describe() == "rounds[generate, reward] -> old_log_prob -> update_actor"
    plan.hold("old_log_prob", "someone needs it")
    with pytest.raises(StagePlanError, match="cannot be wrapped: someone needs it"):
        plan.wrap("old_log_prob", "update_actor", lambda span: Stage("x", _noop))


def test_dapo_prime_and_async_planners_compose():
    pytest.importorskip("verity_recipe_dapo")
    pytest.importorskip("verity_recipe_prime")
    prime = ["algorithm.advantage.estimator=prime", "prime.filter.oversample=2"]
    # PRIME runs first (DAPO declares after=prime), so DAPO's rounds run PRIME's sampling-side stages
    both = build_stage_plan(
        load_config([*prime, "dapo.dynamic_sampling.enabled=true", "dapo.overlong_shaping.enabled=true"])
    )
    assert both.describe() == (
        "dynamic_sampling[prime_oversample, generate, reward, prime_filter, overlong_shaping] -> old_log_prob -> "
        "prm_ref_log_prob -> prm_score -> prm_update -> prm_forward -> prime_advantage -> dapo_signal -> update_actor"
    )
    # async holds its generate: DAPO's shaping composes with it, its dynamic sampling is refused naming both
    plan = build_stage_plan(load_config([*prime, "trainer.mode=async", "dapo.overlong_shaping.enabled=true"]))
    assert plan.names()[:3] == ["prime_oversample", "generate", "reward"]
    assert plan.names()[-2:] == ["update_actor", "rollout_sync"] and "dapo_signal" in plan.names()
    with pytest.raises(
        StagePlanError, match=r"stage planner 'dapo': stage 'generate' cannot be wrapped: trainer.mode=async"
    ):
        build_stage_plan(load_config([*prime, "trainer.mode=async", "dapo.dynamic_sampling.enabled=true"]))
