"""The grpo recipe's pinned configs say what the recipe is; its CPU expected file is a measured promise.

Every config's full validation (GPU configs with stand-in files) is in
harness/tests/test_harness_recipes.py, which covers every recipe folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from verity.config import load_config

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "verity_recipe_grpo"


def test_cpu_config_is_the_embedded_default_with_the_grpo_estimator() -> None:
    cfg = load_config([], config_file=PACKAGE / "configs" / "cpu.yaml")
    assert cfg.model.path == "embedded"
    assert cfg.algorithm.advantage.estimator == "grpo"
    assert cfg.trainer.n_workers == 2 and cfg.rollout.engine == "hf"


def test_gpu_config_pins_the_published_settings() -> None:
    gpu = yaml.safe_load((PACKAGE / "configs" / "gsm8k-qwen2.5-0.5b.yaml").read_text())
    assert gpu["algorithm"]["advantage"]["estimator"] == "grpo"
    assert gpu["model"]["dtype"] == "bfloat16"
    assert gpu["model"]["path"].startswith("/path/to/")  # a placeholder the user replaces
    assert gpu["rollout"]["n"] == 5 and gpu["algorithm"]["kl"]["use_kl_loss"] is True


def test_expected_cpu_file_promises_accuracy() -> None:
    data = yaml.safe_load((PACKAGE / "expected" / "cpu-hf.yaml").read_text())
    metrics = data["configs"]["cpu"]["metrics"]
    assert {"accuracy_after", "accuracy_gain"} <= set(metrics)
    assert data["configs"]["cpu"]["source"] == "measured"


def test_cpu_lora_config_is_the_cpu_config_with_adapters_and_their_learning_rate() -> None:
    from verity.config.loader import config_to_dict

    def flat(node: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in node.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    cpu = flat(config_to_dict(load_config([], config_file=PACKAGE / "configs" / "cpu.yaml")))
    lora = flat(config_to_dict(load_config([], config_file=PACKAGE / "configs" / "cpu-lora.yaml")))
    differ = {key for key in cpu if cpu[key] != lora[key]}
    assert differ == {"actor.lora.rank", "actor.optim.lr"}  # alpha 16 is the default
    assert lora["actor.lora.rank"] == 8 and lora["actor.lora.alpha"] == 16
    assert lora["actor.lora.target_modules"] is None  # every linear layer


def test_gpu_lora_config_pins_verls_published_lora_settings() -> None:
    gpu = yaml.safe_load((PACKAGE / "configs" / "gsm8k-qwen2.5-0.5b-lora.yaml").read_text())
    assert gpu["model"]["path"].startswith("/path/to/")  # a placeholder the user replaces
    assert gpu["actor"]["lora"] == {"rank": 32, "alpha": 32}
    assert gpu["actor"]["optim"]["lr"] == 3.0e-5 and gpu["actor"]["entropy_coeff"] == 0.001
    assert gpu["data"]["train_batch_size"] == 64 and gpu["rollout"]["n"] == 5
    assert gpu["algorithm"]["kl"] == {"use_kl_loss": True, "kl_loss_kind": "k3", "kl_loss_coef": 0.001}
    expected = yaml.safe_load((PACKAGE / "expected" / "cuda-hf.yaml").read_text())
    lora = expected["configs"]["gsm8k-qwen2.5-0.5b-lora"]
    assert lora["source"] == "published" and lora["metrics"]["accuracy_after"]["target"] == 0.543


def test_cpu_tools_config_runs_the_agent_loop_with_the_calculator_on_the_multiply_preset() -> None:
    cfg = load_config([], config_file=PACKAGE / "configs" / "cpu-tools.yaml")
    assert cfg.model.path == "embedded" and cfg.model.embedded_preset == "multiply-tools"
    agent = cfg.rollout.agent
    assert agent.enabled and agent.max_turns == 2
    assert [t.class_name for t in agent.tools] == ["calculator"]
    # a response holds the call (~80 tokens), the calculator's answer and the final answer
    assert cfg.data.max_response_length >= 120
    without = load_config(["rollout.agent.enabled=false"], config_file=PACKAGE / "configs" / "cpu-tools.yaml")
    assert not without.rollout.agent.enabled


def test_cpu_async_config_is_the_cpu_config_one_step_off_policy_and_its_promise_checks_the_mode() -> None:
    from verity.config.loader import config_to_dict
    from verity_harness.expected import find_expectations

    def flat(node: dict, prefix: str = "") -> dict:
        return {
            k: v
            for key, value in node.items()
            for k, v in (
                flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
            ).items()
        }

    cpu = flat(config_to_dict(load_config([], config_file=PACKAGE / "configs" / "cpu.yaml")))
    run = flat(config_to_dict(load_config([], config_file=PACKAGE / "configs" / "cpu-async.yaml")))
    differ = {key for key in cpu if cpu[key] != run[key]}
    # 1 actor + 1 rollout process: the 2 CPUs of cpu's 2 actor workers; is_cap: the one-step-stale batch
    assert differ == {"trainer.mode", "trainer.n_workers", "actor.off_policy.is_cap"}
    assert run["trainer.mode"] == "async" and run["rollout.n_workers"] == 1
    promise = find_expectations(PACKAGE / "expected", "cpu-async", ["cpu-amd-epyc", "cpu"], "hf")
    assert promise is not None and promise.source == "measured" and promise.trainer_mode == "async"
    assert {e.metric for e in promise.expectations} == {"accuracy_before", "accuracy_after", "accuracy_gain"}
    assert promise.check_mode("sync") is not None and promise.check_mode("async") is None


def test_cpu_moe_config_runs_the_moe_preset_with_replay_and_its_measured_gain() -> None:
    cfg = load_config([], config_file=PACKAGE / "configs" / "cpu-moe.yaml")
    assert cfg.model.embedded_preset == "moe" and cfg.rollout.engine == "hf"
    assert cfg.actor.moe.routing_replay and cfg.actor.moe.aux_loss_coef > 0
    data = yaml.safe_load((PACKAGE / "expected" / "cpu-hf.yaml").read_text())
    entry = data["configs"]["cpu-moe"]
    assert entry["source"] == "measured" and entry["metrics"]["accuracy_gain"]["mode"] == "at_least"
