"""GRPO with Ulysses sequence parallelism (``actor.fsdp2.ulysses_sequence_parallel_size=2``) trains as SP=1 does.

Both runs have 2 workers. The rollout is split per rank in both (an SP group shares its training
rows, not its prompts), so the same prompts are sampled with the same seeds. At SP=2 both ranks
train on all 32 rows, each running half of every packed micro-batch's tokens; at SP=1 each rank
trains on its 16 padded rows. The gradients agree up to float32 summation order, so the sampled
tokens, rewards and lengths come out equal and the losses, norms and entropies agree to 1e-4.
The same holds for PPO with the critic split too (its values, then its update: one optimizer step
per mini-batch of the SP group's rows, as at SP=1 per rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.dense_reward import write_digit_reward
from verity.config import load_config

pytestmark = pytest.mark.slow

EQUAL = ("reward/mean", "response_length/mean")
CLOSE = ("actor/loss", "actor/grad_norm", "actor/entropy")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sp2_on_two_workers_trains_as_sp1(tiny_grpo_overrides, tmp_path):
    from verity.launch.run import run_training

    reward = write_digit_reward(tmp_path)  # dense: every step moves the weights
    common = [f"reward.custom_path={reward}", "algorithm.kl.use_kl_loss=true"]  # the reference splits too
    split = run_training(
        load_config(
            tiny_grpo_overrides(
                str(tmp_path / "sp2"), *common, "actor.fsdp2.ulysses_sequence_parallel_size=2"
            )
        )
    )
    whole = run_training(load_config(tiny_grpo_overrides(str(tmp_path / "sp1"), *common)))
    assert split["ran"]["actor_sequence_parallel_size"] == "2"
    assert split["ran"]["actor_attention"] == "verity_ulysses"
    assert "actor_sequence_parallel_size" not in whole["ran"]
    a_rows, b_rows = _rows(tmp_path / "sp2"), _rows(tmp_path / "sp1")
    assert len(a_rows) == len(b_rows) == 3
    assert all(row["actor/grad_norm"] > 0 for row in a_rows)
    for a, b in zip(a_rows, b_rows, strict=True):
        for key in EQUAL:
            assert a[key] == b[key], (key, a[key], b[key])
        for key in CLOSE:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])
    assert split["accuracy_after"] == whole["accuracy_after"]


def test_ppo_with_an_sp2_critic_trains_as_sp1(tiny_grpo_overrides, tmp_path):
    """GAE: the critic's values and update split by sequence too (its workers share rows per SP group)."""
    from verity.launch.run import run_training

    reward = write_digit_reward(tmp_path)
    common = [
        f"reward.custom_path={reward}",
        "algorithm.advantage.estimator=gae",
        "critic.ppo_mini_batch_size=8",
        "critic.micro_batch_size=8",
        "critic.optim.lr=1e-2",
        "trainer.total_steps=2",
        # vf_explained_var is a ratio per micro-batch, averaged: it depends on which rows share a
        # micro-batch. At SP=2 on 2 workers there is one data-parallel group (nothing to balance), so
        # the SP=1 run keeps consecutive ranks too, and both cut the same 8-row micro-batches
        "critic.balance_tokens=false",
        # the rows this seed's equal split draws: a load-balanced rollout draws others, and one of their
        # micro-batches has returns of near-zero variance, where the ratio is rounding noise
        "rollout.balance=split",
    ]
    sp = ["actor.fsdp2.ulysses_sequence_parallel_size=2", "critic.fsdp2.ulysses_sequence_parallel_size=2"]
    split = run_training(load_config(tiny_grpo_overrides(str(tmp_path / "sp2"), *common, *sp)))
    whole = run_training(load_config(tiny_grpo_overrides(str(tmp_path / "sp1"), *common)))
    assert split["ran"]["critic_sequence_parallel_size"] == "2"
    assert "critic_sequence_parallel_size" not in whole["ran"]
    a_rows, b_rows = _rows(tmp_path / "sp2"), _rows(tmp_path / "sp1")
    assert len(a_rows) == len(b_rows) == 2
    for a, b in zip(a_rows, b_rows, strict=True):
        for key in EQUAL:
            assert a[key] == b[key], (key, a[key], b[key])
        for key in (*CLOSE, "critic/value_loss", "critic/grad_norm", "critic/vf_explained_var"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])
