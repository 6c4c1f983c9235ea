"""actor.megatron.expert_parallel_size: refused before start with one sentence, and kept inside a node."""

from __future__ import annotations

import pytest
from helpers.tiny_models import tiny_moe_config
from verity.config import ConfigError, load_config

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

JOINED = "trainer.ray_address=auto"
MEGATRON = "actor.engine=megatron"


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A folder with a tiny Qwen3-MoE's config.json (8 experts): what the config checks read."""
    folder = tmp_path_factory.mktemp("tiny_moe")
    tiny_moe_config().save_pretrained(folder)
    return str(folder)


def test_the_keys_exist_and_default_to_one():
    cfg = load_config([MEGATRON])
    assert (
        cfg.actor.megatron.expert_parallel_size == 1
        and cfg.actor.megatron.expert_tensor_parallel_size is None
    )


def test_an_moe_model_at_ep2_passes(moe_folder):
    cfg = load_config(
        [MEGATRON, f"model.path={moe_folder}", "trainer.n_workers=2", "actor.megatron.expert_parallel_size=2"]
    )
    assert cfg.actor.megatron.expert_parallel_size == 2


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["trainer.n_workers=2", "actor.megatron.expert_parallel_size=4"],
            r"actor.megatron.expert_parallel_size = 4 must divide the data-parallel size 2 \(trainer.n_workers = 2",
        ),
        (
            [
                "trainer.n_workers=3",
                "actor.megatron.expert_parallel_size=3",
                "data.train_batch_size=12",
                "actor.ppo_mini_batch_size=12",
            ],
            r"expert_parallel_size = 3 does not divide the 8 experts of",
        ),
        (
            [
                "trainer.n_workers=4",
                "actor.megatron.expert_parallel_size=2",
                "actor.megatron.tensor_parallel_size=2",
            ],
            r"tensor_parallel_size = 2 with a mixture-of-experts model needs Megatron's sequence parallelism",
        ),
        (["actor.megatron.expert_tensor_parallel_size=2"], r"expert_tensor_parallel_size must be null or 1"),
        (["actor.megatron.expert_parallel_size=0"], r"expert_parallel_size must be an int >= 1"),
    ],
)
def test_bad_expert_settings_are_named(moe_folder, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config([MEGATRON, f"model.path={moe_folder}", *overrides])


def test_a_dense_model_is_refused_at_ep2():
    with pytest.raises(
        ConfigError, match=r"expert_parallel_size = 2 needs a mixture-of-experts model, and .* is dense"
    ):
        load_config([MEGATRON, "trainer.n_workers=2", "actor.megatron.expert_parallel_size=2"])


def test_a_qwen2_moe_is_refused(tmp_path):
    from transformers import Qwen2MoeConfig

    Qwen2MoeConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2
    ).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"is a Qwen2-MoE .* use actor.engine=fsdp2"):
        load_config([MEGATRON, f"model.path={tmp_path}"])


def test_expert_groups_stay_inside_a_node(moe_folder):
    with pytest.raises(
        ConfigError,
        match=r"3 actor workers per node is not a multiple of actor.megatron.expert_parallel_size x "
        r"tensor_parallel_size = 2: an expert-parallel group's token all-to-all must stay inside one node",
    ):
        load_config(
            [
                JOINED,
                MEGATRON,
                f"model.path={moe_folder}",
                "trainer.n_workers=6",
                "trainer.nnodes=2",
                "actor.megatron.expert_parallel_size=2",
                "data.train_batch_size=24",
                "actor.ppo_mini_batch_size=24",
            ]
        )


def test_the_placement_plan_puts_each_expert_group_on_one_node(moe_folder):
    """EP=2 x DP=2 on 2 simulated nodes of 3 free CPUs each: without the group the planner would fill
    the first node (ranks 0-2) and split the second EP group; with it each node takes one whole group."""
    from verity.controller.placement import NodeInfo, plan_placement
    from verity.hardware import get_backend
    from verity.launch.pools import pool_requests

    cfg = load_config(
        [
            JOINED,
            MEGATRON,
            f"model.path={moe_folder}",
            "trainer.n_workers=4",
            "actor.megatron.expert_parallel_size=2",
            "trainer.cpus_per_worker=1",
        ]
    )
    requests = pool_requests(cfg, get_backend("cpu"))
    assert requests[0].group_size == 2
    nodes = [NodeInfo(f"node{i}", f"10.0.0.{i + 1}", {"CPU": 3.0}, is_driver=i == 0) for i in range(2)]
    ranks = plan_placement(requests, nodes).pool("actor").rank_nodes
    groups = [ranks[0:2], ranks[2:4]]
    assert all(len(set(group)) == 1 for group in groups) and ranks[0] != ranks[2]


def test_verity_train_stops_before_start_with_exit_2(monkeypatch, capsys):
    from verity.cli import train as train_cli

    def no_run(cfg):
        raise AssertionError("the run started")

    monkeypatch.setattr("verity.launch.run.run_training", no_run)
    code = train_cli.main([MEGATRON, "trainer.n_workers=2", "actor.megatron.expert_parallel_size=4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "actor.megatron.expert_parallel_size = 4 must divide the data-parallel size 2" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
