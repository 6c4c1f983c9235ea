"""The ppo recipe's pinned configs say what the recipe is; its CPU expected file is a measured promise.

Every config's full validation (GPU configs with stand-in files) is in
harness/tests/test_harness_recipes.py, which covers every recipe folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from verity.config import load_config

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "verity_recipe_ppo"


def test_cpu_config_is_the_embedded_default_with_the_ppo_estimator() -> None:
    cfg = load_config([], config_file=PACKAGE / "configs" / "cpu.yaml")
    assert cfg.model.path == "embedded"
    assert cfg.algorithm.advantage.estimator == "gae"
    assert cfg.critic.enabled in (None, True)  # on: GAE needs values
    assert cfg.trainer.n_workers == 2 and cfg.rollout.engine == "hf"


def test_gpu_config_pins_the_published_settings() -> None:
    gpu = yaml.safe_load((PACKAGE / "configs" / "gsm8k-qwen2.5-0.5b.yaml").read_text())
    assert gpu["algorithm"]["advantage"]["estimator"] == "gae"
    assert gpu["model"]["dtype"] == "bfloat16"
    assert gpu["model"]["path"].startswith("/path/to/")  # a placeholder the user replaces
    assert gpu["critic"]["enabled"] is True and gpu["algorithm"]["kl"]["use_kl_in_reward"] is True


def test_expected_cpu_file_promises_accuracy() -> None:
    data = yaml.safe_load((PACKAGE / "expected" / "cpu-hf.yaml").read_text())
    metrics = data["configs"]["cpu"]["metrics"]
    assert {"accuracy_after", "accuracy_gain"} <= set(metrics)
    assert data["configs"]["cpu"]["source"] == "measured"
