"""A 3-step GRPO run of the tiny Qwen3-MoE (model.embedded_preset=moe) through Ray, FSDP2 and the HF rollout,
with the load-balancing loss, rollout routing replay and a KL loss to the reference on: the router metrics reach
metrics.jsonl and MLflow, and what ran says so."""

from __future__ import annotations

import json

import pytest
from verity.config import load_config


@pytest.mark.slow
def test_moe_grpo_with_routing_replay_records_router_metrics(tmp_path) -> None:
    from mlflow import MlflowClient
    from verity.launch.run import run_training

    cfg = load_config(
        [
            "model.embedded_preset=moe",
            "model.embedded_sft_steps=20",  # a short warm-start: this checks the plumbing, not learning
            f"model.embedded_cache_dir={tmp_path / 'embedded'}",
            "data.train_batch_size=8",
            "data.val_max_samples=16",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=4",
            "actor.moe.aux_loss_coef=0.01",
            "actor.moe.z_loss_coef=0.001",
            "actor.moe.routing_replay=true",
            "actor.old_logprobs=rollout",  # the update's behaviour log-probs are the sampler's: the gap is logged
            "algorithm.kl.use_kl_loss=true",  # the reference policy (the MoE, routing on its own) runs too
            "trainer.total_steps=3",
            "trainer.val_every=0",
            "trainer.n_workers=2",
            "trainer.cpus_per_worker=0.5",
            "trainer.progress=false",
            f"trainer.output_dir={tmp_path / 'run'}",
        ]
    )
    summary = run_training(cfg)
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert 1.0 <= row["moe/expert_load_max_over_mean"] <= row["moe/expert_load_max_over_mean_max"] <= 4.0
        assert row["moe/aux_loss"] > 0 and row["moe/z_loss"] > 0 and row["moe/router_entropy"] > 0
        # the float32 rollout and trainer route alike; the replayed routes reached the update
        assert row["moe/replay_route_agreement"] > 0.95
        assert row["actor/behaviour_logprob_gap"] < 0.01
        assert abs(row["actor/kl"]) < 0.05  # a few small steps away from the reference
    ran = summary["ran"]  # read back from the built engines
    assert ran["actor_moe_layers"] == "2" and ran["actor_routing_replay"] == "true"
    assert ran["rollout_records_routes"] == "true"
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    history = client.get_metric_history(summary["run_id"], "moe/aux_loss")
    assert [m.step for m in history] == [1, 2, 3]
