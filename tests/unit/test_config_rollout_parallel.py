"""rollout.tensor_parallel_size: checked before any worker starts (verity.config.rollout_checks)."""

from __future__ import annotations

import pytest
from verity.config import ConfigError, load_config
from verity.config.cluster_checks import model_parallel_size
from verity.config.key_aliases import alias_for

JOINED = "trainer.ray_address=auto"


def test_replicas_of_the_actor_ranks_are_accepted_and_kept_inside_a_node():
    cfg = load_config(["trainer.n_workers=2", "rollout.tensor_parallel_size=2"])
    assert cfg.rollout.tensor_parallel_size == 2
    assert model_parallel_size(cfg) == 2  # the placement keeps each replica's ranks on one node
    cfg = load_config(
        [JOINED, "trainer.nnodes=2", "trainer.n_workers_per_node=2", "rollout.tensor_parallel_size=2"]
    )
    assert cfg.trainer.n_workers == 4


def test_a_size_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(
        ConfigError, match=r"trainer.n_workers = 3 is not a multiple of rollout.tensor_parallel_size = 2"
    ):
        load_config(["trainer.n_workers=3", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "rollout.tensor_parallel_size=2"])
    with pytest.raises(
        ConfigError, match=r"2 workers per node .* a rollout replica must stay inside one node"
    ):
        load_config(
            [JOINED, "trainer.nnodes=2", "trainer.n_workers_per_node=2", "rollout.tensor_parallel_size=4"]
        )


def test_a_size_that_does_not_divide_the_heads_is_refused():
    # the embedded model: 4 attention heads, 2 key/value heads
    with pytest.raises(
        ConfigError, match=r"does not divide the model's 4 attention heads and 2 key/value heads"
    ):
        load_config(["trainer.n_workers=4", "rollout.tensor_parallel_size=4"])


def test_an_engine_without_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError, match=r"the 'sglang' rollout engine does not split the policy"):
        load_config(["trainer.n_workers=2", "rollout.engine=sglang", "rollout.tensor_parallel_size=2"])


def test_vllm_replicas_are_accepted_without_vllms_own_tensor_parallelism():
    cfg = load_config(["trainer.n_workers=2", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"])
    assert cfg.rollout.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"leave rollout.vllm.tensor_parallel_size at 1"):
        load_config(
            [
                "trainer.n_workers=2",
                "rollout.engine=vllm",
                "rollout.tensor_parallel_size=2",
                "rollout.vllm.tensor_parallel_size=2",
            ]
        )
    with pytest.raises(ConfigError, match=r"rollout.vllm.in_process = false with rollout.tensor_parallel_size"):
        load_config(
            [
                "trainer.n_workers=2",
                "rollout.engine=vllm",
                "rollout.tensor_parallel_size=2",
                "rollout.vllm.in_process=false",
            ]
        )


def test_async_replicas_come_from_the_rollout_group():
    with pytest.raises(
        ConfigError, match=r"rollout.n_workers = 3 is not a multiple of rollout.tensor_parallel_size = 2"
    ):
        load_config(["trainer.mode=async", "rollout.n_workers=3", "rollout.tensor_parallel_size=2"])


def test_verl_key_points_at_the_new_one():
    assert (
        alias_for("rollout.tensor_model_parallel_size", lambda key: True)[0] == "rollout.tensor_parallel_size"
    )


def test_async_replicas_run_the_hf_engine_only():
    with pytest.raises(ConfigError, match=r"the rollout group's replicas run the hf engine only"):
        load_config(
            ["trainer.mode=async", "rollout.n_workers=2", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"]
        )
