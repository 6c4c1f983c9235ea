"""PPO with a critic (GAE) for two steps through the whole stack: values, critic update, actor update."""

from __future__ import annotations

import json
import math

import pytest
from verity.config import load_config


def _overrides(paths: dict[str, str], out: str) -> list[str]:
    return [
        f"model.path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        "data.val_max_samples=16",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=8",
        "actor.optim.lr=1e-3",
        "algorithm.advantage.estimator=gae",
        "algorithm.advantage.gamma=1.0",
        "algorithm.advantage.lam=0.95",
        "critic.ppo_mini_batch_size=8",
        "critic.micro_batch_size=4",
        "critic.optim.lr=1e-2",
        "trainer.total_steps=2",
        "trainer.n_workers=2",
        "trainer.cpus_per_worker=0.5",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]


@pytest.mark.slow
def test_ppo_with_critic_runs_end_to_end(tiny_model_and_task, tmp_path) -> None:
    from verity.launch.run import run_training

    summary = run_training(load_config(_overrides(tiny_model_and_task, str(tmp_path / "ppo"))))
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    first, last = rows
    for key in (
        "timing/values_s",
        "timing/update_critic_s",
        "critic/value_loss",
        "critic/vf_clip_frac",
        "critic/vf_explained_var",
        "critic/grad_norm",
        "actor/pg_loss",
    ):
        assert key in last, key
    assert last["critic/optimizer_steps"] == 1.0  # 8 prompts / critic mini-batch of 8
    assert last["actor/optimizer_steps"] == 2.0  # 8 prompts / actor mini-batch of 4
    # The value head starts at zero, so the values of the first step are exactly 0.
    assert first["critic/vpred_mean"] == 0.0
    for row in rows:
        assert math.isfinite(row["critic/value_loss"]) and row["critic/value_loss"] >= 0.0
        assert math.isfinite(row["critic/grad_norm"])
    assert 0.0 <= summary["accuracy_after"] <= 1.0
