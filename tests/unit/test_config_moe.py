"""actor.moe: checked before any worker starts (verity.config.moe_checks); ``verity train`` exits 2."""

from __future__ import annotations

import pytest
from verity.config import ConfigError, load_config

MOE = "model.embedded_preset=moe"
REPLAY = "actor.moe.routing_replay=true"


def test_the_moe_preset_takes_router_losses_and_routing_replay():
    cfg = load_config([MOE, REPLAY, "actor.moe.aux_loss_coef=0.01", "actor.moe.z_loss_coef=0.001"])
    assert cfg.actor.moe.routing_replay and cfg.actor.moe.aux_loss_coef == 0.01
    assert load_config([]).actor.moe.routing_replay is False


@pytest.mark.parametrize("key", [REPLAY, "actor.moe.aux_loss_coef=0.01", "actor.moe.z_loss_coef=0.01"])
def test_moe_keys_on_a_dense_model_are_refused(key):
    with pytest.raises(
        ConfigError, match=r"needs a mixture-of-experts model .* 'qwen2' model without routed experts"
    ):
        load_config([key])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "rollout.engine=vllm",
            r"routing_replay=true needs a rollout that records .* rollout.engine=hf, not 'vllm'",
        ),
        (
            "actor.megatron.pipeline_parallel_size=2",
            r"routing_replay=true needs actor.megatron.pipeline_parallel_size=1, not 2",
        ),
    ],
)
def test_routing_replay_needs_an_engine_that_records_and_replays(override, message):
    extra = ["actor.engine=megatron", "trainer.n_workers=2"] if "megatron" in override else []
    with pytest.raises(ConfigError, match=message):
        load_config([MOE, REPLAY, override, *extra])


def test_the_megatron_engine_takes_router_losses_and_routing_replay():
    keys = ["actor.moe.aux_loss_coef=0.01", "actor.moe.z_loss_coef=0.001", REPLAY]
    cfg = load_config([MOE, "actor.engine=megatron", "actor.megatron.expert_parallel_size=2", *keys])
    assert cfg.actor.engine == "megatron" and cfg.actor.moe.routing_replay
    assert cfg.actor.moe.z_loss_coef == 0.001


def test_routing_replay_with_the_agent_loop_is_refused():
    agent = ["rollout.agent.enabled=true", "rollout.agent.tools=[{class_name: calculator}]"]
    with pytest.raises(ConfigError, match=r"routing_replay=true needs single-turn rollouts: the agent loop"):
        load_config([MOE, REPLAY, *agent])
    assert load_config([MOE, *agent]).rollout.agent.enabled  # without replay the MoE agent run is fine


def test_a_negative_coefficient_is_refused():
    with pytest.raises(ConfigError, match=r"actor.moe.aux_loss_coef"):
        load_config([MOE, "actor.moe.aux_loss_coef=-1"])


def test_verity_train_refuses_replay_on_vllm_in_one_sentence_with_exit_2(capsys):
    from verity.cli.train import main

    assert main([MOE, REPLAY, "rollout.engine=vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "actor.moe.routing_replay=true" in err and "'vllm'" in err
