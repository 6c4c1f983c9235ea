"""The prime recipe's configs say what the recipe is; its config sections reject what would go unused.

Every config's full validation (GPU configs with stand-in files) is in
harness/tests/test_harness_recipes.py, which covers every recipe folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from verity.config import ConfigError, load_config

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "verity_recipe_prime"


def cpu(*overrides: str):
    return load_config(list(overrides), config_file=PACKAGE / "configs" / "cpu.yaml")


def test_cpu_config_is_the_embedded_default_with_the_prime_estimator_and_rloos_settings() -> None:
    cfg = cpu()
    assert cfg.model.path == "embedded"
    assert cfg.algorithm.advantage.estimator == "prime"
    assert cfg.trainer.n_workers == 2 and cfg.rollout.engine == "hf"
    assert cfg.prm.placement == "colocated" and cfg.prm.update in ("before", "after")
    assert (cfg.prime.filter.accuracy_lower, cfg.prime.filter.accuracy_upper) == (0.2, 0.8)
    rloo = load_config(
        [], config_file=PACKAGE.parents[2] / "rloo" / "src" / "verity_recipe_rloo" / "configs" / "cpu.yaml"
    )
    for key in ("data", "rollout", "actor", "trainer"):
        assert getattr(cfg, key) == getattr(rloo, key), key  # the side-by-side is like for like


def test_gpu_config_pins_the_published_settings() -> None:
    gpu = yaml.safe_load((PACKAGE / "configs" / "gsm8k-qwen2.5-0.5b.yaml").read_text())
    assert gpu["algorithm"]["advantage"]["estimator"] == "prime"
    assert gpu["model"]["path"].startswith("/path/to/")  # a placeholder the user replaces
    assert gpu["rollout"]["n"] == 4 and gpu["data"]["train_batch_size"] == 64
    assert gpu["prm"]["beta"] == 0.05 and gpu["prm"]["update"] == "before"
    assert (gpu["prime"]["outcome_weight"], gpu["prime"]["process_weight"]) == (5.0, 5.0)
    assert gpu["prime"]["filter"]["oversample"] == 4


def test_expected_files() -> None:
    data = yaml.safe_load((PACKAGE / "expected" / "cpu-hf.yaml").read_text())
    assert {"accuracy_after", "accuracy_gain"} <= set(data["configs"]["cpu"]["metrics"])
    assert data["configs"]["cpu"]["source"] == "measured"
    gpu = yaml.safe_load((PACKAGE / "expected" / "cuda-hf.yaml").read_text())["configs"]["gsm8k-qwen2.5-0.5b"]
    assert gpu["source"] == "published" and gpu["metrics"]["accuracy_after"]["target"] == 0.587


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["prm.beta=0"], "prm: beta must be > 0"),
        (["prm.update=sometimes"], "prm: update must be one of before|after|none"),
        (["prm.n_workers=2"], "prm: n_workers = 2 applies only to placement=separate"),
        (["prm.engine=nope"], "prm: engine: unknown training engine 'nope'"),
        (["prm.optim.lr=-1"], "prm: optim.lr must be >= 0"),
        (["prm.fsdp2.offload_optimizer=true"], "prm: fsdp2.offload_optimizer=true: the PRM's engines do not offload"),
        (["prime.filter.accuracy_lower=0.9"], r"prime: filter.need 0 <= accuracy_lower <= accuracy_upper <= 1"),
        (["prime.outcome_weight=0", "prime.process_weight=0"], "both 0"),
        (["prime.process_reward_norm=batch"], "prime: process_reward_norm must be one of none|max_abs_return"),
        (["prime.filter.enabled=false", "prime.filter.oversample=2"], "oversample > 1 needs the filter enabled"),
        (["algorithm.kl.use_kl_in_reward=true"], "use_kl_in_reward is not supported with the prime estimator"),
        (["prm.mini_batch_size=3", "rollout.n=3", "trainer.n_workers=2", "actor.ppo_mini_batch_size=2", "data.train_batch_size=2"],
         r"prm.mini_batch_size x rollout.n = 3 x 3 = 9 rows does not divide over the PRM's 2 workers"),
    ],
)  # fmt: skip
def test_bad_prime_settings_fail_before_anything_runs(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        cpu(*overrides)


def test_prime_sections_are_rejected_when_the_estimator_is_not_prime() -> None:
    load_config(["algorithm.advantage.estimator=rloo"])  # untouched sections: fine
    with pytest.raises(ConfigError, match=r"prm.beta, prm.optim.lr set, but the PRM runs only with"):
        load_config(["algorithm.advantage.estimator=rloo", "prm.beta=0.1", "prm.optim.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"prime.filter.oversample set, but PRIME runs only with"):
        load_config(["prime.filter.oversample=2"])


def test_a_separate_prm_gets_its_own_pool() -> None:
    from verity.launch.roles import cpus_needed
    from verity.workers.registry import ROLES, role_placement

    cfg = cpu("prm.placement=separate", "prm.n_workers=1")
    assert role_placement(ROLES.get("prm"), cfg) == ("separate", 1)
    assert (
        cpus_needed(cfg)
        == cfg.trainer.n_workers * cfg.trainer.cpus_per_worker + 1 * cfg.trainer.cpus_per_worker
    )
    assert role_placement(ROLES.get("prm"), cpu()) == ("colocated", 2)
