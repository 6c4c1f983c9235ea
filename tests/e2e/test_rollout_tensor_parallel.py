"""GRPO with a tensor-parallel rollout (``rollout.tensor_parallel_size=2``) trains as the TP=1 rollout does.

The comparison keeps the rollout's work the same: a replica of 2 ranks generates what one rank
alone generates at TP=1 (the same prompts, the same seed: replica ``i`` seeds as rank ``i`` did).
So TP=2 on 2 workers (one replica) is compared with TP=1 on 1 worker, and TP=2 on 2 simulated
nodes x 2 workers (one replica per node) with TP=1 on 2 workers. Sampled tokens come out the
same: the split model's logits differ from the whole one's only by float32 summation order
(about 1e-7), far below what moves a sampled token; so the rewards and response lengths are
equal, and the losses agree to 1e-4 (training itself runs on a different number of FSDP ranks,
which sums the gradients in another order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.dense_reward import write_digit_reward
from helpers.sim_cluster import simulated_cluster
from verity.config import load_config

pytestmark = pytest.mark.slow

EQUAL = ("reward/mean", "response_length/mean")
CLOSE = ("actor/loss", "actor/grad_norm", "actor/entropy")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_training(split: Path, whole: Path) -> None:
    a_rows, b_rows = _rows(split), _rows(whole)
    assert len(a_rows) == len(b_rows) == 3
    assert all(row["actor/grad_norm"] > 0 for row in a_rows)  # the weights move: three real syncs
    for a, b in zip(a_rows, b_rows, strict=True):
        for key in EQUAL:
            assert a[key] == b[key], (key, a[key], b[key])
        for key in CLOSE:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])


def _halved_weights(split: Path, whole: Path) -> None:
    """Each rank holds and receives about half of what a whole rollout holds (norms are whole everywhere)."""
    a, b = _rows(split)[-1], _rows(whole)[-1]
    assert 0.45 < a["perf/rollout_weight_bytes"] / b["perf/rollout_weight_bytes"] < 0.55
    full = b["perf/weight_sync_bytes"]  # every weight, as the whole rollout receives it
    assert 0.45 < a["perf/weight_sync_bytes"] / full < 0.55  # the slices handed to the rollout
    assert 0.45 < a["perf/weight_sync_received_bytes"] / full < 0.6  # what crossed the wire to the rank
    assert a["perf/rollout_released_bytes"] == a["perf/rollout_weight_bytes"]  # given back after generate


def test_tp2_on_two_workers_trains_as_one_whole_rollout(tiny_grpo_overrides, tmp_path):
    from verity.launch.run import run_training

    reward = write_digit_reward(tmp_path)  # dense: every step moves the weights
    split = run_training(
        load_config(
            tiny_grpo_overrides(
                str(tmp_path / "tp2"), f"reward.custom_path={reward}", "rollout.tensor_parallel_size=2"
            )
        )
    )
    whole = run_training(
        load_config(
            tiny_grpo_overrides(str(tmp_path / "tp1"), f"reward.custom_path={reward}", "trainer.n_workers=1")
        )
    )
    assert split["ran"]["rollout_tensor_parallel_size"] == "2"
    assert "rollout_tensor_parallel_size" not in whole["ran"]
    _same_training(tmp_path / "tp2", tmp_path / "tp1")
    _halved_weights(tmp_path / "tp2", tmp_path / "tp1")
    assert split["accuracy_after"] == whole["accuracy_after"]  # greedy held-out answers, split or whole


def test_tp2_replicas_stay_inside_each_of_two_nodes(tiny_grpo_overrides, tmp_path):
    from verity.launch.run import run_training

    reward = write_digit_reward(tmp_path)
    with simulated_cluster(head={"num_cpus": 2}, nodes=[{"num_cpus": 2}]) as cluster:
        joined = [f"trainer.ray_address={cluster.address}", f"reward.custom_path={reward}"]
        split = run_training(
            load_config(
                tiny_grpo_overrides(
                    str(tmp_path / "tp2"),
                    *joined,
                    "trainer.nnodes=2",
                    "trainer.n_workers=4",
                    "trainer.n_workers_per_node=2",
                    "rollout.tensor_parallel_size=2",
                )
            )
        )
        whole = run_training(
            load_config(tiny_grpo_overrides(str(tmp_path / "tp1"), *joined, "trainer.nnodes=1"))
        )
    # "node/a:0-1,node/b:2-3": ranks 0-1 (the first replica) on one node, 2-3 on the other
    spans = [span.rsplit(":", 1) for span in split["ran"]["placement.actor"].split(",")]
    assert [ranks for _, ranks in spans] == ["0-1", "2-3"] and spans[0][0] != spans[1][0]
    assert split["ran"]["rollout_tensor_parallel_size"] == "2"
    assert split["accuracy_after"] == whole["accuracy_after"]
    _same_training(tmp_path / "tp2", tmp_path / "tp1")
    _halved_weights(tmp_path / "tp2", tmp_path / "tp1")


def test_async_rollout_group_forms_tp2_replicas(tiny_grpo_overrides, tmp_path):
    """trainer.mode=async: the rollout's own 2 workers form one replica, read the model folder and each
    published bucket as slices, and generate what one whole rollout worker generates."""
    from verity.launch.run import run_training

    reward = write_digit_reward(tmp_path)
    common = [f"reward.custom_path={reward}", "trainer.mode=async", "trainer.n_workers=1"]
    split = run_training(
        load_config(
            tiny_grpo_overrides(
                str(tmp_path / "tp2"), *common, "rollout.n_workers=2", "rollout.tensor_parallel_size=2"
            )
        )
    )
    whole = run_training(
        load_config(tiny_grpo_overrides(str(tmp_path / "tp1"), *common, "rollout.n_workers=1"))
    )
    assert split["ran"]["rollout_tensor_parallel_size"] == "2"
    assert split["accuracy_after"] == whole["accuracy_after"]
    _same_training(tmp_path / "tp2", tmp_path / "tp1")
    a, b = _rows(tmp_path / "tp2")[-1], _rows(tmp_path / "tp1")[-1]
    assert 0.45 < a["async/rollout_weight_bytes"] / b["async/rollout_weight_bytes"] < 0.55
