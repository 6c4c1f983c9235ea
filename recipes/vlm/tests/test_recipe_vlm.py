"""The vlm recipe's pinned configs say what the recipe is; its CPU expected file is a measured promise.

Every config's full validation (GPU configs with stand-in files) is in
harness/tests/test_harness_recipes.py, which covers every recipe folder.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml
from verity.config import load_config

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "verity_recipe_vlm"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_cpu_config_is_grpo_on_the_visual_preset() -> None:
    cfg = load_config([], config_file=PACKAGE / "configs" / "cpu.yaml")
    assert cfg.model.path == "embedded" and cfg.model.embedded_preset == "shape-count"
    assert cfg.algorithm.advantage.estimator == "grpo"
    assert cfg.trainer.n_workers == 2 and cfg.rollout.engine == "hf" and cfg.actor.engine == "fsdp2"


def test_gpu_config_pins_verls_published_geo3k_settings() -> None:
    gpu = yaml.safe_load((PACKAGE / "configs" / "geo3k-qwen2.5-vl-7b.yaml").read_text())
    assert gpu["model"]["path"].startswith("/path/to/")  # a placeholder the user replaces
    assert gpu["data"]["train_batch_size"] == 512 and gpu["rollout"]["n"] == 5
    assert gpu["data"]["max_prompt_length"] == 1024 and gpu["data"]["max_response_length"] == 2048
    assert gpu["actor"]["optim"]["lr"] == 1.0e-6 and gpu["actor"]["ppo_mini_batch_size"] == 128
    assert gpu["algorithm"]["kl"] == {"use_kl_loss": True, "kl_loss_kind": "k3", "kl_loss_coef": 0.01}
    expected = yaml.safe_load((PACKAGE / "expected" / "cuda-hf.yaml").read_text())
    geo3k = expected["configs"]["geo3k-qwen2.5-vl-7b"]
    assert geo3k["source"] == "published" and geo3k["metrics"]["val/reward"]["target"] == 0.654


def test_expected_cpu_file_promises_accuracy() -> None:
    data = yaml.safe_load((PACKAGE / "expected" / "cpu-hf.yaml").read_text())
    metrics = data["configs"]["cpu"]["metrics"]
    assert {"accuracy_before", "accuracy_gain"} <= set(metrics)
    assert data["configs"]["cpu"]["source"] == "measured"


def test_the_image_blind_ceiling_is_the_best_answer_per_colour() -> None:
    spec = importlib.util.spec_from_file_location("blank_ablation", SCRIPTS / "blank_ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def row(colour: str, answer: str) -> dict:
        return {"extra_info": {"colour": colour}, "reward_model": {"ground_truth": answer}}

    rows = [row("red", "1"), row("red", "1"), row("red", "2"), row("blue", "0"), row("blue", "3")]
    assert module.image_blind_ceiling(rows) == 3 / 5
