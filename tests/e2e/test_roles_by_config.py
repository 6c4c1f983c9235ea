"""Roles switched on and placed by config: a reward model colocated with the actor, a critic in its own group."""

from __future__ import annotations

import json
import os

import pytest
from verity.config import load_config


@pytest.mark.slow
def test_reward_model_and_separate_critic_run_from_config(tiny_model_and_task, tmp_path) -> None:
    from verity.launch.run import run_training

    paths = tiny_model_and_task
    out = tmp_path / "run"
    summary = run_training(
        load_config(
            [
                f"model.path={paths['model']}",
                f"data.train_files=[{paths['train']}]",
                f"data.val_files=[{paths['test']}]",
                "data.train_batch_size=4",
                "data.max_prompt_length=32",
                "data.max_response_length=4",
                "data.val_max_samples=8",
                "rollout.n=2",
                "actor.ppo_mini_batch_size=2",
                "critic.ppo_mini_batch_size=2",
                "algorithm.advantage.estimator=gae",
                "critic.placement=separate",
                "critic.n_workers=1",
                "reward_model.enabled=true",
                f"reward_model.model_path={paths['model']}",  # a causal LM gets a fresh scalar head
                "reward_model.weight=0.5",
                "trainer.total_steps=2",
                "trainer.n_workers=2",
                "trainer.cpus_per_worker=0.5",
                "trainer.progress=false",
                "trainer.checkpoint.every=2",
                f"trainer.output_dir={out}",
            ]
        )
    )
    assert "reward_model" in summary["stage_plan"] and "update_critic" in summary["stage_plan"]
    # two colocated ranks: the reward model sharded over the actor's group, one reader filling it
    assert summary["ran"]["reward_model_weights_loaded"] == "streamed"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/rm_score_mean" in row and "critic/value_loss" in row for row in rows)
    workers = json.loads((out / "workers.json").read_text())
    assert sorted(workers) == ["actor+reward_model", "critic"]  # two groups: colocated pair, separate critic
    assert len(workers["critic"]) == 1 and len(workers["actor+reward_model"]) == 2
    # a private cluster's workers run at the driver's priority (Ray's default: 15 nice levels lower)
    assert {w["niceness"] for group in workers.values() for w in group} == {os.nice(0)}
    assert {w["pid"] for w in workers["critic"]}.isdisjoint(w["pid"] for w in workers["actor+reward_model"])
    assert sorted(p.name for p in (out / "checkpoints" / "step_2").iterdir() if p.is_dir()) == [
        "actor",
        "critic",
        "hf",
    ]  # trained roles are checkpointed; the frozen reward model is not
