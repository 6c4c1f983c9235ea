"""trainer.nnodes x trainer.n_workers_per_node = trainer.n_workers, and each separate role's nnodes."""

from __future__ import annotations

import pytest
from verity.config import ConfigError, load_config

JOINED = "trainer.ray_address=auto"


def test_n_workers_is_derived_from_nodes_times_workers_per_node():
    cfg = load_config(
        [JOINED, "trainer.nnodes=2", "trainer.n_workers_per_node=4", "data.train_batch_size=32"]
    )
    assert cfg.trainer.n_workers == 8


def test_a_given_total_must_agree_with_the_shape():
    with pytest.raises(ConfigError, match=r"trainer.n_workers = 2 is the total .* = 2 x 4 = 8"):
        load_config([JOINED, "trainer.n_workers=2", "trainer.nnodes=2", "trainer.n_workers_per_node=4"])
    with pytest.raises(ConfigError, match=r"trainer.n_workers = 2 does not divide over trainer.nnodes = 4"):
        load_config([JOINED, "trainer.nnodes=4"])
    with pytest.raises(ConfigError, match=r"trainer.nnodes must be >= 1"):
        load_config([JOINED, "trainer.nnodes=0"])


def test_several_nodes_need_a_cluster_to_join():
    with pytest.raises(
        ConfigError, match=r"trainer.nnodes=2 spans several nodes, which needs a Ray cluster to join"
    ):
        load_config(["trainer.nnodes=2"])
    with pytest.raises(ConfigError, match=r"critic.nnodes=2 spans several nodes"):
        load_config(
            [
                "algorithm.advantage.estimator=gae",
                "critic.placement=separate",
                "critic.n_workers=2",
                "critic.nnodes=2",
            ]
        )


def test_a_role_nnodes_needs_its_own_group_and_must_divide_it():
    with pytest.raises(ConfigError, match=r"critic.nnodes = 2 applies only to placement=separate"):
        load_config([JOINED, "algorithm.advantage.estimator=gae", "critic.nnodes=2"])
    with pytest.raises(ConfigError, match=r"critic.nnodes = 2: the group's 3 workers must divide"):
        load_config(
            [
                JOINED,
                "algorithm.advantage.estimator=gae",
                "critic.placement=separate",
                "critic.n_workers=3",
                "critic.nnodes=2",
            ]
        )
    cfg = load_config(
        [
            JOINED,
            "trainer.mode=async",
            "rollout.n_workers=4",
            "rollout.nnodes=2",
            "algorithm.advantage.estimator=rloo",
        ]
    )
    assert cfg.rollout.nnodes == 2


def test_megatron_groups_stay_inside_a_node():
    pytest.importorskip("megatron.core")
    with pytest.raises(ConfigError, match=r"1 actor workers per node is not a multiple of .* = 2"):
        load_config(
            [
                JOINED,
                "actor.engine=megatron",
                "actor.megatron.tensor_parallel_size=2",
                "trainer.nnodes=2",
                "actor.fsdp2.sharding=full",
            ]
        )


def test_placement_timeout_must_be_positive():
    with pytest.raises(ConfigError, match=r"trainer.placement_timeout_s must be > 0"):
        load_config(["trainer.placement_timeout_s=0"])


def test_ray_address_from_the_environment_is_the_cluster_to_join(monkeypatch):
    from verity.config.cluster_checks import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(load_config([])) is None  # a private cluster
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # as `ray job submit` sets it for its entrypoint
    cfg = load_config(["trainer.nnodes=2"])  # several nodes: fine, there is a cluster to join
    assert cluster_address(cfg) == "10.0.0.1:6379"
    assert cluster_address(load_config(["trainer.ray_address=auto"])) == "auto"  # the key wins
