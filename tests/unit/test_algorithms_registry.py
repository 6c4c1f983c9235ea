"""Registries, bad input and configs of verity.algorithms."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from verity.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AggregationContext,
    EntropyConfig,
    KLConfig,
    PolicyLossConfig,
    Registry,
    UnknownNameError,
    ValueLossConfig,
    aggregate_loss,
    compute_advantages,
    get_policy_loss,
    kl_penalty,
)

REWARDS = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
MASK = torch.ones(2, 2)
GROUP = torch.tensor([0, 0])


def test_every_issue_estimator_and_loss_is_registered():
    for name in ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                 "remax", "opo", "gpg", "grpo_passk"):  # fmt: skip
        assert name in ADVANTAGE_ESTIMATORS
    for name in ("ppo", "gspo", "gpg", "cispo", "clip_cov", "kl_cov"):
        assert callable(get_policy_loss(name))


def test_unknown_estimator_lists_known_names():
    with pytest.raises(UnknownNameError) as err:
        compute_advantages("grpoo", token_rewards=REWARDS, response_mask=MASK, group=GROUP)
    message = str(err.value)
    assert "grpoo" in message and "grpo" in message and "rloo" in message and "gae" in message
    assert isinstance(err.value, ValueError)


def test_unknown_loss_kind_and_mode_list_known_names():
    with pytest.raises(UnknownNameError, match=r"ppo.*") as err:
        get_policy_loss("ppo2")
    assert "cispo" in str(err.value) and "kl_cov" in str(err.value)
    with pytest.raises(UnknownNameError, match="k3"):
        kl_penalty(REWARDS, REWARDS, "k4")
    ctx = AggregationContext.from_mask(MASK)
    with pytest.raises(UnknownNameError, match="seq-mean-token-mean"):
        aggregate_loss(REWARDS, MASK, "mean", ctx)


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk"]
)
def test_group_estimator_without_groups_says_so(name):
    with pytest.raises(ValueError, match="needs group ids") as err:
        compute_advantages(name, token_rewards=REWARDS, response_mask=MASK, group=None)
    assert "group=None" in str(err.value)


def test_missing_values_and_baseline_scores():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", token_rewards=REWARDS, response_mask=MASK)
    with pytest.raises(ValueError, match="baseline_scores"):
        compute_advantages("remax", token_rewards=REWARDS, response_mask=MASK)


def test_estimators_without_groups_run_without_them():
    advantages, returns = compute_advantages("reinforce_plus_plus", token_rewards=REWARDS, response_mask=MASK)
    # undiscounted returns-to-go of each row; advantages: those whitened over the batch's tokens
    assert torch.equal(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert advantages.shape == (2, 2) and advantages.mean().abs() < 1e-6
    assert advantages[0].gt(advantages[1]).all()
    advantages, returns = compute_advantages(
        "gae", token_rewards=REWARDS, response_mask=MASK, values=torch.zeros(2, 2)
    )
    assert torch.equal(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # gamma = lam = 1, values 0
    assert advantages.shape == (2, 2) and advantages[0].gt(advantages[1]).all()


def test_bad_shapes_and_dtypes_name_the_input():
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages("grpo", token_rewards=REWARDS, response_mask=torch.ones(2, 3), group=GROUP)
    with pytest.raises(ValueError, match="group"):
        compute_advantages("grpo", token_rewards=REWARDS, response_mask=MASK, group=torch.tensor([0, 0, 1]))
    with pytest.raises(TypeError, match="group"):
        compute_advantages("grpo", token_rewards=REWARDS, response_mask=MASK, group=torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="token_rewards"):
        compute_advantages("grpo", token_rewards=torch.zeros(2), response_mask=MASK, group=GROUP)
    with pytest.raises(TypeError, match="token_rewards"):
        compute_advantages("grpo", token_rewards=[[0.0]], response_mask=MASK, group=GROUP)
    with pytest.raises(ValueError, match="old_logprobs"):
        get_policy_loss("ppo")(
            logprobs=REWARDS,
            old_logprobs=torch.zeros(2, 3),
            advantages=REWARDS,
            response_mask=MASK,
            agg=AggregationContext.from_mask(MASK),
            config=PolicyLossConfig(),
        )
    with pytest.raises(TypeError, match="agg"):
        get_policy_loss("ppo")(
            logprobs=REWARDS,
            old_logprobs=REWARDS,
            advantages=REWARDS,
            response_mask=MASK,
            agg=None,
            config=PolicyLossConfig(),
        )
    with pytest.raises(ValueError, match="global_tokens"):
        AggregationContext(-1.0, 1.0, 2)


def test_registry_refuses_duplicates_and_resolves_aliases():
    reg: Registry = Registry("widget")
    reg.add("a", 1, "alias_a")
    with pytest.raises(ValueError, match="already registered"):
        reg.add("alias_a", 2)
    assert reg.get("alias_a") == 1 and reg.canonical("alias_a") == "a"
    assert reg.names() == ["a", "alias_a"]
    with pytest.raises(UnknownNameError, match="known widgets: a, alias_a"):
        reg.get("b")


@pytest.mark.parametrize("cls", [AdvantageConfig, PolicyLossConfig, ValueLossConfig, KLConfig, EntropyConfig])
def test_configs_are_hydra_structured_configs(cls):
    cfg = OmegaConf.structured(cls)
    obj = OmegaConf.to_object(cfg)
    assert obj == cls()
    obj.validate()


def test_config_validation_messages():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=1.0).validate()
    with pytest.raises(ValueError, match="gamma"):
        AdvantageConfig(gamma=1.5).validate()
    with pytest.raises(ValueError, match="cliprange_value"):
        ValueLossConfig(cliprange_value=0.0).validate()
    with pytest.raises(ValueError, match="clip_cov_lb"):
        PolicyLossConfig(clip_cov_lb=5.0, clip_cov_ub=1.0).validate()
    with pytest.raises(ValueError, match="kl_target"):
        KLConfig(kl_ctrl="adaptive", kl_target=0.0).validate()
    cfg = OmegaConf.structured(PolicyLossConfig)
    cfg.clip_ratio_c = 3.0  # Optional float accepts a value and None
    cfg.clip_ratio_c = None
