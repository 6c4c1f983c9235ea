"""PRIME's stages and planner with a stand-in PRM role (no processes): plan, filter, PRM calls, advantage."""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch
from verity.config import load_config
from verity.trainer.stage_plan import build_stage_plan
from verity.trainer.stages import StepContext
from verity_recipe_prime import config_path
from verity_recipe_prime.estimator import prime_advantages
from verity_recipe_prime.stages import filter_groups, groups_in_range, oversample, prime_advantage, prm_update

BASE = ["generate", "reward", "old_log_prob", "advantage", "update_actor"]


def prime_cfg(*overrides: str):
    return load_config(list(overrides), config_file=config_path("cpu"))


def test_the_plan_of_each_prm_update_mode_and_of_the_filter() -> None:
    names = build_stage_plan(prime_cfg()).names()
    assert names == [
        "generate", "reward", "prime_filter", "old_log_prob", "prm_ref_log_prob",
        "prm_score", "prm_update", "prm_forward", "prime_advantage", "update_actor",
    ]  # fmt: skip
    after = build_stage_plan(prime_cfg("prm.update=after", "prime.filter.enabled=false")).names()
    assert after == [
        "generate", "reward", "old_log_prob", "prm_ref_log_prob", "prm_forward", "prm_update",
        "prime_advantage", "update_actor",
    ]  # fmt: skip
    frozen = build_stage_plan(prime_cfg("prm.update=none", "prime.filter.oversample=3")).names()
    assert frozen[:4] == ["prime_oversample", "generate", "reward", "prime_filter"]
    assert frozen[-4:] == ["prm_ref_log_prob", "prm_forward", "prime_advantage", "update_actor"]
    kl = build_stage_plan(prime_cfg("algorithm.kl.use_kl_loss=true")).names()
    assert kl[3:6] == ["old_log_prob", "ref_log_prob", "prm_ref_log_prob"]


def test_other_estimators_keep_their_plan_and_roles() -> None:
    from verity.workers.registry import enabled_roles

    for estimator in ("grpo", "rloo"):
        cfg = load_config([f"algorithm.advantage.estimator={estimator}"])
        assert build_stage_plan(cfg).names() == BASE
        assert [r.name for r in enabled_roles(cfg)] == ["actor"]
    assert [r.name for r in enabled_roles(prime_cfg())] == ["actor", "prm"]


def test_groups_in_range_keeps_first_drawn_groups_up_to_the_limit() -> None:
    group = torch.tensor([5, 5, 9, 9, 2, 2, 7, 7])
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # group accuracy 0.5, 1.0, 0.5, 0.5
    keep = groups_in_range(group, acc, 0.2, 0.8, limit=10)
    assert keep.tolist() == [True, True, False, False, True, True, True, True]
    keep = groups_in_range(group, acc, 0.2, 0.8, limit=2)  # first drawn first: groups 5 and 2
    assert keep.tolist() == [True, True, False, False, True, True, False, False]
    assert groups_in_range(group, acc, 0.5, 0.5, limit=10).tolist() == [True, True, False, False] + [True] * 4
    assert not groups_in_range(group, acc, 0.6, 0.9, limit=10).any()


def _rows(acc: list[float], n: int) -> Batch:
    rows = len(acc)
    mask = torch.ones(rows, 3)
    ids = torch.arange(rows * 5).reshape(rows, 5)
    return Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones(rows, 5, dtype=torch.long),
            "position_ids": torch.arange(5).repeat(rows, 1),
            "responses": ids[:, 2:],
            "response_mask": mask,
            "group": torch.arange(rows // n).repeat_interleave(n),
            "acc": torch.tensor(acc),
            "scores": torch.tensor(acc) * 2.0,
        }
    )


def test_filter_stage_keeps_in_range_groups_and_logs_the_share_and_the_outcomes() -> None:
    cfg = prime_cfg(
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "prm.mini_batch_size=2", "rollout.n=4"
    )
    ctx = StepContext(cfg, None, None, None, step=1)
    batch = _rows([1, 1, 1, 1] + [1, 0, 0, 0] + [1, 1, 0, 0] + [0, 0, 0, 0], n=4)
    kept = filter_groups(ctx, batch)
    assert kept["group"].tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert ctx.metrics["prime/kept_share"] == 0.5 and ctx.metrics["prime/groups_kept"] == 2.0
    assert ctx.metrics["prime/acc_mean"] == pytest.approx(7 / 16)
    assert ctx.metrics["prime/outcome_reward_mean"] == pytest.approx(14 / 16)  # before filtering
    none = filter_groups(ctx, _rows([1, 1, 1, 1, 0, 0, 0, 0], n=4))
    assert len(none) == 0 and ctx.metrics["prime/kept_share"] == 0.0


class FakeLoader:
    def __init__(self) -> None:
        self.drawn = 0

    def next_batch(self) -> Batch:
        self.drawn += 1
        return Batch.from_dict({"input_ids": torch.full((2, 3), self.drawn)})


def test_oversample_draws_more_prompt_batches_from_the_loader() -> None:
    loader = FakeLoader()
    ctx = StepContext(prime_cfg("prime.filter.oversample=3"), None, None, None, step=1, loader=loader)
    prompts = oversample(ctx, Batch.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long)}))
    assert loader.drawn == 2 and prompts["input_ids"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]


class FakePRM:
    def __init__(self) -> None:
        self.updates: list[Batch] = []

    def update_prm(self, batch: Batch) -> dict[str, float]:
        self.updates.append(batch)
        return {"prm/loss": 0.6}


def test_prm_update_sends_the_labels_and_refuses_labels_outside_0_1() -> None:
    prm = FakePRM()
    ctx = StepContext(prime_cfg(), None, None, None, step=1, roles={"prm": prm})
    batch = _rows([1, 0, 1, 0], n=2)
    batch["prm_ref_logprobs"] = torch.zeros(4, 3)
    prm_update(ctx, batch)
    assert prm.updates[0]["acc"].tolist() == [1, 0, 1, 0] and ctx.metrics["prm/loss"] == 0.6
    batch["acc"] = torch.tensor([1.0, 2.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"labels \(acc\) must lie in \[0, 1\]"):
        prm_update(ctx, batch)


def test_prime_advantage_stage_uses_the_scores_the_process_rewards_and_the_config() -> None:
    cfg = prime_cfg("prime.outcome_weight=2.0", "prime.process_weight=0.5", "prime.whiten=true")
    ctx = StepContext(cfg, None, None, None, step=1)
    batch = _rows([1, 0, 1, 1], n=2)
    batch["prm_process_rewards"] = torch.tensor(
        [[0.1, 0.2, 0.3], [0.0, -0.1, 0.1], [0.5, 0.0, 0.0], [0.2, 0.2, 0.2]]
    )
    out = prime_advantage(ctx, batch)
    want, returns = prime_advantages(
        outcome_scores=batch["scores"], process_rewards=batch["prm_process_rewards"],
        response_mask=batch["response_mask"], group=batch["group"],
        outcome_weight=2.0, process_weight=0.5, whiten=True,
    )  # fmt: skip
    torch.testing.assert_close(out["advantages"], want)
    torch.testing.assert_close(out["returns"], returns)
    assert ctx.metrics["prime/process_reward_mean"] == pytest.approx(1.7 / 12)
    assert ctx.metrics["prime/process_score_mean"] == pytest.approx(1.7 / 4)
