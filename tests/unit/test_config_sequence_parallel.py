"""actor/critic.fsdp2.ulysses_sequence_parallel_size: checked before any worker starts (verity.config.sequence_parallel_checks)."""

from __future__ import annotations

import pytest
from verity.config import ConfigError, load_config
from verity.config.key_aliases import alias_for

JOINED = "trainer.ray_address=auto"
SP2 = "actor.fsdp2.ulysses_sequence_parallel_size=2"


def test_sp_groups_of_the_actor_ranks_are_accepted_and_the_reference_follows():
    cfg = load_config(["trainer.n_workers=2", SP2])
    assert cfg.actor.fsdp2.ulysses_sequence_parallel_size == 2
    from verity.workers.actor_rollout import reference_options

    assert reference_options(cfg).ulysses_sequence_parallel_size == 2
    assert load_config([]).actor.fsdp2.ulysses_sequence_parallel_size == 1


def test_a_size_that_does_not_divide_the_workers_or_a_node_is_refused():
    with pytest.raises(
        ConfigError, match=r"must divide trainer.n_workers = 3: every SP group needs 2 whole ranks"
    ):
        load_config(["trainer.n_workers=3", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", SP2])
    with pytest.raises(
        ConfigError, match=r"must divide the 2 workers per node: .* must stay inside one node"
    ):
        load_config(
            [
                JOINED,
                "trainer.nnodes=2",
                "trainer.n_workers_per_node=2",
                "actor.fsdp2.ulysses_sequence_parallel_size=4",
            ]
        )


def test_the_placement_keeps_each_sp_group_on_one_node():
    from verity.config.cluster_checks import model_parallel_size

    assert model_parallel_size(load_config(["trainer.n_workers=4", SP2])) == 2
    gae = ["trainer.n_workers=4", "algorithm.advantage.estimator=gae"]
    assert model_parallel_size(load_config([*gae, "critic.fsdp2.ulysses_sequence_parallel_size=2"])) == 2
    assert model_parallel_size(load_config([*gae, SP2, "rollout.tensor_parallel_size=2"])) == 2
    assert model_parallel_size(load_config([])) == 1


def test_a_size_that_does_not_divide_the_heads_is_refused():
    # the embedded model: 4 attention heads, 2 key/value heads
    with pytest.raises(ConfigError, match=r"must divide the model's 4 attention heads and 2 key/value heads"):
        load_config(["trainer.n_workers=4", "actor.fsdp2.ulysses_sequence_parallel_size=4"])


def test_the_critic_is_checked_on_its_own_section():
    gae = ["algorithm.advantage.estimator=gae", "trainer.n_workers=4"]
    assert (
        load_config(
            [*gae, "critic.fsdp2.ulysses_sequence_parallel_size=2"]
        ).critic.fsdp2.ulysses_sequence_parallel_size
        == 2
    )
    with pytest.raises(
        ConfigError, match=r"critic.fsdp2.ulysses_sequence_parallel_size = 4 must divide the model's"
    ):
        load_config([*gae, "critic.fsdp2.ulysses_sequence_parallel_size=4"])


def test_megatron_lora_and_bad_values_are_refused_in_one_sentence():
    with pytest.raises(
        ConfigError, match=r"needs actor.engine=fsdp2: the 'megatron' engine does not split sequences"
    ):
        load_config(["trainer.n_workers=2", "actor.engine=megatron", SP2])
    with pytest.raises(ConfigError, match=r"with LoRA adapters .* is not supported yet"):
        load_config(["trainer.n_workers=2", "actor.lora.rank=4", SP2])
    with pytest.raises(ConfigError, match=r"with fsdp2.compile=true is not supported yet"):
        load_config(["trainer.n_workers=2", SP2, "actor.fsdp2.compile=true"])
    with pytest.raises(
        ConfigError, match=r"splits the packed layout, so actor.fsdp2.packed=false cannot be kept"
    ):
        load_config(["trainer.n_workers=2", SP2, "actor.fsdp2.packed=false"])
    assert load_config(["trainer.n_workers=2", SP2, "actor.fsdp2.packed=true"]).actor.fsdp2.packed is True
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size must be an int >= 1"):
        load_config(["actor.fsdp2.ulysses_sequence_parallel_size=0"])


def test_verls_key_names_point_at_the_fsdp2_setting():
    for verl, ours in [
        (
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "actor.fsdp2.ulysses_sequence_parallel_size",
        ),
        (
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
            "actor.fsdp2.ulysses_sequence_parallel_size",
        ),
        ("critic.ulysses_sequence_parallel_size", "critic.fsdp2.ulysses_sequence_parallel_size"),
    ]:
        assert alias_for(verl, lambda key, ours=ours: key == ours)[0] == ours
    with pytest.raises(ConfigError, match=r"actor.fsdp2.ulysses_sequence_parallel_size"):
        load_config(["actor.ulysses_sequence_parallel_size=2"])
