"""The dapo recipe's pinned configs say what DAPO is; its expected files are a measured and a published promise.

Every config's full validation (GPU configs with stand-in files) is in
harness/tests/test_harness_recipes.py, which covers every recipe folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from verity.config import load_config
from verity.trainer.stage_plan import build_stage_plan
from verity_toyworld.presets import EMBEDDED_PRESETS

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "verity_recipe_dapo"


def pinned(cfg) -> None:
    """Every DAPO component on: clip-higher, token-level loss, no KL, dynamic sampling, overlong shaping and filter."""
    loss = cfg.actor.policy_loss
    assert (loss.name, loss.clip_ratio_low, loss.clip_ratio_high, loss.loss_agg_mode) == (
        "ppo",
        0.2,
        0.28,
        "token-mean",
    )
    assert not cfg.algorithm.kl.use_kl_loss and not cfg.algorithm.kl.use_kl_in_reward
    assert cfg.algorithm.advantage.estimator == "grpo" and cfg.actor.entropy_coeff == 0.0
    d = cfg.dapo
    assert (
        d.dynamic_sampling.enabled
        and d.dynamic_sampling.metric == "acc"
        and d.dynamic_sampling.max_num_gen_batches == 10
    )
    assert d.overlong_shaping.enabled and d.overlong_shaping.penalty_factor == 1.0


def test_cpu_config_runs_every_component_on_the_dapo_preset() -> None:
    cfg = load_config([], config_file=PACKAGE / "configs" / "cpu.yaml")
    pinned(cfg)
    assert cfg.dapo.overlong_filter.enabled
    assert cfg.model.path == "embedded" and cfg.model.embedded_preset == "dapo-arith4"
    assert EMBEDDED_PRESETS.get("dapo-arith4").data_source == "math_dapo"
    assert cfg.trainer.n_workers == 2 and cfg.rollout.engine == "hf"
    assert cfg.rollout.val_n == 8 and cfg.rollout.val_temperature == 1.0
    assert (
        cfg.actor.ppo_mini_batch_size < cfg.data.train_batch_size
    )  # several updates per step: the clip acts
    assert build_stage_plan(cfg).names() == [
        "dynamic_sampling", "old_log_prob", "advantage", "dapo_signal", "update_actor"
    ]  # fmt: skip


def test_gpu_config_pins_the_papers_settings() -> None:
    gpu = yaml.safe_load((PACKAGE / "configs" / "aime-qwen2.5-32b.yaml").read_text())
    assert gpu["model"]["path"].startswith("/path/to/") and gpu["data"]["train_files"][0].startswith(
        "/path/to/"
    )
    assert (gpu["data"]["train_batch_size"], gpu["rollout"]["n"], gpu["actor"]["ppo_mini_batch_size"]) == (
        512,
        16,
        32,
    )
    assert (
        gpu["data"]["max_response_length"] == 20480 and gpu["dapo"]["overlong_shaping"]["buffer_len"] == 4096
    )
    assert gpu["rollout"]["val_n"] == 32 and gpu["actor"]["optim"]["lr"] == 1e-6


def test_expected_files_promise_avg_at_k() -> None:
    cpu = yaml.safe_load((PACKAGE / "expected" / "cpu-hf.yaml").read_text())["configs"]["cpu"]
    assert cpu["source"] == "measured" and {"avg_at_k_after", "avg_at_k_gain"} <= set(cpu["metrics"])
    assert cpu["metrics"]["dapo/zero_adv_group_share"]["target"] == 0.0
    gpu = yaml.safe_load((PACKAGE / "expected" / "cuda-hf.yaml").read_text())["configs"]["aime-qwen2.5-32b"]
    assert gpu["source"] == "published" and gpu["metrics"]["avg_at_k_after"]["target"] == 0.50
