"""A stage a planner holds cannot be replaced or removed by a later edit."""

from __future__ import annotations

import pytest
from verity.trainer.stage_plan import StagePlan, StagePlanError
from verity.trainer.stages import Stage


def _noop(ctx, batch):
    return batch


def test_a_held_stage_cannot_be_replaced_or_removed_and_the_reason_is_given():
    plan = StagePlan([Stage("generate", _noop), Stage("update_actor", _noop)])
    plan.hold("generate", "mode X generates ahead")
    with pytest.raises(
        StagePlanError, match="'generate' cannot be replaced or removed: mode X generates ahead"
    ):
        plan.replace("generate", Stage("sampling", _noop))
    with pytest.raises(StagePlanError, match="mode X"):
        plan.remove("generate")
    plan.replace("update_actor", Stage("update_actor", _noop))  # other stages stay editable
    plan.insert_after("generate", Stage("reward", _noop))
    assert plan.names() == ["generate", "reward", "update_actor"]


def test_holding_a_missing_stage_names_the_plan():
    with pytest.raises(StagePlanError, match="no stage 'generate'"):
        StagePlan([Stage("update_actor", _noop)]).hold("generate", "why")
