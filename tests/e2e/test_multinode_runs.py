"""Runs that span nodes, on a simulated Ray cluster (a head and a second node on this machine).

The cluster: the head (the driver's node) and one more node, 2 CPUs each. Ranks are ordered
node by node, rank 0 on the driver's node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.dense_reward import write_digit_reward
from helpers.sim_cluster import simulated_cluster
from verity.config import load_config

pytestmark = pytest.mark.slow

STEP_KEYS = ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean", "actor/pg_clipfrac")


@pytest.fixture(scope="module")
def two_nodes():
    with simulated_cluster(head={"num_cpus": 2}, nodes=[{"num_cpus": 2}]) as cluster:
        yield cluster


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _nodes_of(placement: str) -> list[str]:
    """``"ip/ab12:0,ip/cd34:1"`` -> ``["ip/ab12", "ip/cd34"]``."""
    return [span.rsplit(":", 1)[0] for span in placement.split(",")]


def test_grpo_on_two_nodes_matches_one_node(two_nodes, tiny_grpo_overrides, tmp_path, capsys):
    from verity.launch.run import run_training

    reward = write_digit_reward(tmp_path)  # dense: every step moves the weights
    joined = [
        f"trainer.ray_address={two_nodes.address}",
        "trainer.cpus_per_worker=1",
        f"reward.custom_path={reward}",
    ]
    spread = run_training(
        load_config(
            tiny_grpo_overrides(
                str(tmp_path / "spread"), *joined, "trainer.nnodes=2", "trainer.n_workers_per_node=1"
            )
        )
    )
    printed = capsys.readouterr().out
    packed = run_training(
        load_config(tiny_grpo_overrides(str(tmp_path / "packed"), *joined, "trainer.nnodes=1"))
    )

    assert "verity: placement on 2 node(s):" in printed
    spread_nodes = _nodes_of(spread["ran"]["placement.actor"])
    assert len(set(spread_nodes)) == 2 and spread["ran"]["nodes"] == "2"
    packed_nodes = _nodes_of(packed["ran"]["placement.actor"])
    assert len(packed_nodes) == 1 and packed["ran"]["nodes"] == "1"
    assert packed_nodes[0] == spread_nodes[0]  # rank 0 on the driver's node both times

    # gloo sums the same two gradients in the same order wherever the ranks run: equal, not close
    assert all(row["actor/grad_norm"] > 0 for row in _rows(tmp_path / "spread"))
    for a, b in zip(_rows(tmp_path / "spread"), _rows(tmp_path / "packed"), strict=True):
        for key in STEP_KEYS:
            assert a[key] == b[key], (key, a[key], b[key])
    assert spread["accuracy_after"] == packed["accuracy_after"]


def test_separate_critic_lands_on_the_other_node(two_nodes, tiny_grpo_overrides, tmp_path):
    from verity.launch.run import run_training

    summary = run_training(
        load_config(
            tiny_grpo_overrides(
                str(tmp_path / "ppo"),
                f"trainer.ray_address={two_nodes.address}",
                "trainer.cpus_per_worker=1",
                "trainer.total_steps=2",
                "algorithm.advantage.estimator=gae",
                "critic.placement=separate",
                "critic.n_workers=2",
                "critic.ppo_mini_batch_size=8",
                "critic.micro_batch_size=8",
                "actor.fsdp2.shard_vocab=true",
                "critic.fsdp2.shard_vocab=true",
            )
        )
    )
    actor_nodes = _nodes_of(summary["ran"]["placement.actor"])
    critic_nodes = _nodes_of(summary["ran"]["placement.critic"])
    assert len(actor_nodes) == 1 and len(critic_nodes) == 1  # 2 workers fit one node each
    assert actor_nodes != critic_nodes
    assert summary["ran"]["nodes"] == "2"
    # two ranks each: the actor and the critic were built empty and given their shards by rank 0
    assert summary["ran"]["actor_weights_loaded"] == summary["ran"]["critic_weights_loaded"] == "streamed"
    # and their vocabularies kept in row shards (the rollout synced from them, the reference beside)
    assert summary["ran"]["actor_vocab_sharded"] == summary["ran"]["critic_vocab_sharded"] == "true"
    rows = _rows(tmp_path / "ppo")
    assert len(rows) == 2 and all("critic/value_loss" in row for row in rows)


def test_async_rollout_group_on_the_other_node(two_nodes, tiny_grpo_overrides, tmp_path):
    from verity.launch.run import run_training

    summary = run_training(
        load_config(
            tiny_grpo_overrides(
                str(tmp_path / "async"),
                f"trainer.ray_address={two_nodes.address}",
                "trainer.cpus_per_worker=1",
                "trainer.mode=async",
                "rollout.n_workers=2",
            )
        )
    )
    actor_nodes = _nodes_of(summary["ran"]["placement.actor"])
    rollout_nodes = _nodes_of(summary["ran"]["placement.rollout"])
    assert actor_nodes != rollout_nodes  # weights synced to, and rows fetched from, the other node
    rows = _rows(tmp_path / "async")
    assert len(rows) == 3 and all(row["response_length/mean"] > 0 for row in rows)


def test_shapes_the_cluster_cannot_hold_are_refused_in_one_sentence(
    two_nodes, tiny_grpo_overrides, tmp_path, capsys
):
    from verity.cli.train import execute

    joined = [f"trainer.ray_address={two_nodes.address}", "trainer.cpus_per_worker=1"]
    # 3 workers per node: no node of this cluster holds them, so no wait
    cfg = load_config(
        tiny_grpo_overrides(
            str(tmp_path / "wide"),
            *joined,
            "trainer.n_workers=3",
            "trainer.nnodes=1",
            "actor.ppo_mini_batch_size=8",
            "rollout.n=3",
            "data.train_batch_size=8",
        )
    )
    code, _ = execute(cfg, "verity train")
    err = capsys.readouterr().err
    assert code == 2
    assert "the 'actor' pool asked for 3 workers of {CPU: 1} on 1 node(s), 3 per node" in err
    assert "no node of this cluster, even idle, holds one node's share of actor" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1

    # 3 nodes: a third node could still join, so the wait is bounded by trainer.placement_timeout_s
    cfg = load_config(
        tiny_grpo_overrides(
            str(tmp_path / "three"),
            *joined,
            "trainer.n_workers=3",
            "trainer.nnodes=3",
            "trainer.placement_timeout_s=2",
            "rollout.n=3",
            "data.train_batch_size=8",
        )
    )
    code, _ = execute(cfg, "verity train")
    err = capsys.readouterr().err
    assert code == 2
    assert "waited 2 s for nodes to join (trainer.placement_timeout_s)" in err
    assert "Traceback" not in err


def test_megatron_tensor_parallel_groups_stay_inside_a_node(two_nodes, tiny_grpo_overrides, tmp_path):
    pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    from verity.launch.run import run_training

    summary = run_training(
        load_config(
            tiny_grpo_overrides(
                str(tmp_path / "megatron"),
                f"trainer.ray_address={two_nodes.address}",
                "trainer.cpus_per_worker=1",
                "trainer.n_workers=4",
                "trainer.nnodes=2",
                "trainer.n_workers_per_node=2",
                "trainer.total_steps=2",
                "actor.engine=megatron",
                "actor.megatron.tensor_parallel_size=2",  # TP=2 x DP=2 over 4 ranks
            )
        )
    )
    ran = summary["ran"]
    spans = ran["placement.actor"].split(",")
    assert [span.rsplit(":", 1)[1] for span in spans] == ["0-1", "2-3"]  # ranks node by node
    assert len({span.rsplit(":", 1)[0] for span in spans}) == 2
    # each rank all-gathered its TP group's NODE_RANKs: one node per group (rank 0's answer)
    assert ran["actor"] == "megatron" and ran["actor_model_parallel_nodes"] == "1"
    assert ran["actor_weights_loaded"] == "streamed"  # each rank read its stage's tensors itself
    assert len(_rows(tmp_path / "megatron")) == 2


def test_verity_train_joins_the_cluster_in_ray_address_and_chooses_the_shape(
    two_nodes, tiny_grpo_overrides, tmp_path
):
    # what `ray job submit -- verity train ...` does: the entrypoint runs with RAY_ADDRESS set, no address key
    import os
    import subprocess
    import sys

    out = tmp_path / "job"
    args = tiny_grpo_overrides(
        str(out), "trainer.cpus_per_worker=2", "trainer.total_steps=1", "trainer.val_before_train=false"
    )
    env = {**os.environ, "RAY_ADDRESS": two_nodes.address}
    done = subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"joining the Ray cluster at RAY_ADDRESS={two_nodes.address}" in done.stdout
    # 2 workers of 2 CPUs: no node holds both, so the plan chose 2 nodes x 1 and printed it
    assert "verity: placement on 2 node(s):" in done.stdout
    ran = json.loads((out / "summary.json").read_text())["ran"]
    assert ran["nodes"] == "2" and len(_nodes_of(ran["placement.actor"])) == 2
