"""A key is used or rejected: settings a run would not read fail the config check, naming key and fix.

Also the trainer's range checks (:mod:`verity.config.trainer_checks`) and the held-out
pass reading ``rollout.val_top_p``.
"""

from __future__ import annotations

import ast
import glob
import inspect
import textwrap
from pathlib import Path

import pytest
from verity.config import ConfigError, VerityConfig, load_config
from verity.config import loader as config_loader
from verity.config.idle_settings import ESTIMATOR_KEYS, check_idle_settings, idle_parts

ROOT = Path(__file__).resolve().parents[2]

IDLE = [
    # (overrides, the idle key, words of the reason, words of the fix)
    (["critic.optim.lr=0.1"], "critic.optim.lr=0.1", "this run has no critic", "critic.enabled=true"),
    (["critic.enabled=false", "critic.placement=separate"], "critic.placement='separate'", "critic.enabled=false", ""),
    (["reward_model.model_path=/x"], "reward_model.model_path='/x'", "reward_model.enabled=false", "enabled=true"),
    (["rollout.vllm.kv_cache_bytes=1000000"], "rollout.vllm.kv_cache_bytes", "rollout.engine=hf", "engine=vllm"),
    (["rollout.sglang.mem_fraction_static=0.7"], "rollout.sglang.mem_fraction_static", "rollout.engine=hf", ""),
    (["actor.megatron.tensor_parallel_size=2"], "actor.megatron.tensor_parallel_size", "actor.engine=fsdp2", ""),
    (
        ["actor.fsdp2.sharding=replicate", "actor.fsdp2.reshard_after_forward=false"],
        "actor.fsdp2.reshard_after_forward=False",
        "sharding=replicate",
        "sharding=full",
    ),
    (["rollout.n_workers=2"], "rollout.n_workers=2", "trainer.mode=sync", "trainer.mode=async"),
    (["rollout.val_top_p=0.5"], "rollout.val_top_p=0.5", "val_temperature=0", "val_temperature > 0"),
    (["algorithm.kl.kl_coef=0.1"], "algorithm.kl.kl_coef=0.1", "use_kl_in_reward=false", "use_kl_in_reward=true"),
    (
        ["algorithm.kl.use_kl_in_reward=true", "algorithm.kl.kl_target=0.5"],
        "algorithm.kl.kl_target=0.5",
        "kl_ctrl=fixed",
        "adaptive",
    ),
    (["algorithm.kl.kl_loss_coef=0.1"], "algorithm.kl.kl_loss_coef=0.1", "use_kl_loss=false", "use_kl_loss=true"),
    (["algorithm.kl.kl_clamp=5.0"], "algorithm.kl.kl_clamp=5.0", "no KL term", ""),
    (["actor.policy_loss.gspo_clip_ratio_low=0.001"], "gspo_clip_ratio_low", "name=ppo", "name=gspo"),
    (["actor.policy_loss.kl_cov_coef=2.0"], "kl_cov_coef=2.0", "name=ppo", "name=kl_cov"),
    (["algorithm.advantage.lam=0.9"], "algorithm.advantage.lam=0.9", "estimator=grpo does not read it", "gae"),
    (
        ["algorithm.advantage.estimator=rloo", "algorithm.advantage.norm_by_std=false"],
        "norm_by_std=False",
        "estimator=rloo",
        "grpo",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "reason", "fix"), IDLE, ids=[" ".join(c[0]) for c in IDLE])
def test_a_setting_the_run_would_not_read_is_rejected(overrides, key, reason, fix) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    message = str(err.value)
    assert "would have no effect" in message
    assert key in message and reason in message and fix in message, message


USED = [
    ["critic.enabled=true", "critic.optim.lr=0.1"],
    ["algorithm.advantage.estimator=gae", "critic.optim.lr=0.1", "algorithm.advantage.lam=0.9"],
    ["algorithm.advantage.estimator=reinforce_plus_plus", "algorithm.advantage.gamma=0.99"],
    ["algorithm.advantage.estimator=gpg", "algorithm.advantage.gpg_norm_by_std=true"],
    ["algorithm.kl.use_kl_in_reward=true", "algorithm.kl.kl_coef=0.1", "algorithm.kl.kl_clamp=5.0"],
    ["algorithm.kl.use_kl_in_reward=true", "algorithm.kl.kl_ctrl=adaptive", "algorithm.kl.kl_target=0.5"],
    ["algorithm.kl.use_kl_loss=true", "algorithm.kl.kl_loss_coef=0.1"],
    ["actor.policy_loss.name=gspo", "actor.policy_loss.gspo_clip_ratio_low=0.001"],
    ["actor.policy_loss.name=kl-cov", "actor.policy_loss.kl_cov_coef=2.0"],
    ["rollout.val_temperature=0.7", "rollout.val_top_p=0.5"],
    ["trainer.mode=async", "rollout.n_workers=2"],
    # a value equal to the default is never an error, whatever the run uses
    ["critic.optim.lr=1e-5", "algorithm.advantage.lam=1.0", "rollout.vllm.enforce_eager=true"],
]


@pytest.mark.parametrize("overrides", USED, ids=[" ".join(c) for c in USED])
def test_a_setting_the_run_reads_is_accepted(overrides) -> None:
    cfg = load_config(overrides)
    for override in overrides:  # the values arrived as set
        key, value = override.split("=", 1)
        node = cfg
        for name in key.split("."):
            node = getattr(node, name)
        assert str(node).lower() == value.lower() or float(node) == float(value), (key, node, value)


def test_every_idle_key_is_listed_in_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["critic.placement=separate", "critic.n_workers=2", "algorithm.kl.kl_coef=0.5"])
    message = str(err.value)
    assert "critic.placement='separate', critic.n_workers=2" in message
    assert "algorithm.kl.kl_coef=0.5" in message


def test_defaults_have_no_idle_setting() -> None:
    check_idle_settings(VerityConfig())


def test_embedded_only_keys_are_idle_with_a_local_model() -> None:
    cfg = VerityConfig()
    cfg.model.path = "/some/checkpoint"
    cfg.model.embedded_sft_steps = 500
    with pytest.raises(ConfigError, match="model.embedded_sft_steps=500: model.path is '/some/checkpoint'"):
        check_idle_settings(cfg)
    cfg.model.path = "embedded"
    check_idle_settings(cfg)


def test_an_estimator_that_does_not_declare_its_keys_is_not_second_guessed() -> None:
    from verity.algorithms.advantages_base import register_advantage_estimator
    from verity.algorithms.registry import ADVANTAGE_ESTIMATORS

    @register_advantage_estimator("test_undeclared_estimator", needs_group=True)
    def undeclared(**_: object):  # pragma: no cover - never called
        raise AssertionError

    try:
        cfg = VerityConfig()
        cfg.algorithm.advantage.estimator = "test_undeclared_estimator"
        cfg.algorithm.advantage.lam = 0.5
        check_idle_settings(cfg)
        assert not [p for p in idle_parts(cfg) if p.prefix.startswith("algorithm.advantage")]
    finally:
        ADVANTAGE_ESTIMATORS._entries.pop("test_undeclared_estimator", None)
        ADVANTAGE_ESTIMATORS._canonical.pop("test_undeclared_estimator", None)


def _config_fields_read(fn) -> set[str]:
    """``config.<name>`` attribute reads in ``fn``'s code (docstrings left out)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "config"
    }


def test_built_in_estimators_declare_exactly_the_keys_their_code_reads() -> None:
    import verity.algorithms  # noqa: F401
    from verity.algorithms.registry import ADVANTAGE_ESTIMATORS

    for name, spec in ADVANTAGE_ESTIMATORS.items():
        if not spec.fn.__module__.startswith("verity.algorithms"):
            continue
        assert spec.reads is not None, f"built-in estimator {name} declares no reads"
        assert set(spec.reads) == _config_fields_read(spec.fn), name
        assert set(spec.reads) - {"eps", "whiten_eps"} <= set(ESTIMATOR_KEYS), name


def test_shipped_recipe_configs_set_nothing_idle(monkeypatch) -> None:
    # the GPU configs name model folders that are not here: only the idle check runs
    monkeypatch.setattr(config_loader, "validate_config", check_idle_settings)
    files = sorted(glob.glob(str(ROOT / "recipes/*/src/*/configs/*.yaml")))
    assert len(files) >= 10
    for path in files:
        load_config([], config_file=path)


TRAINER = [
    (["trainer.val_every=-1"], "trainer.val_every must be >= 0"),
    (["trainer.cpus_per_worker=0"], "trainer.cpus_per_worker must be > 0"),
    (["trainer.device=tpu"], "trainer.device must be one of auto|cpu|cuda|rocm|npu|gpu"),
    (["rollout.top_k=-5"], "rollout.top_k must be >= -1 (0 or -1: no top-k), got -5"),
    (["data.val_max_samples=0"], "data.val_max_samples must be >= 1 or -1"),
    (["trainer.device=cpu", "rollout.engine=sglang"], "rollout.engine=sglang runs on CUDA devices only"),
    (
        ["trainer.device=cpu", "rollout.engine=vllm", "rollout.vllm.enable_sleep_mode=true"],
        "rollout.vllm.enable_sleep_mode=true on the CPU (trainer.device=cpu)",
    ),
]


@pytest.mark.parametrize(("overrides", "needle"), TRAINER, ids=[" ".join(c[0]) for c in TRAINER])
def test_trainer_settings_out_of_range_are_named(overrides, needle) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert needle in str(err.value)


def test_top_k_minus_one_and_gpu_device_names_are_accepted() -> None:
    cfg = load_config(["rollout.top_k=-1", "trainer.device=gpu"])
    assert (cfg.rollout.top_k, cfg.trainer.device) == (-1, "gpu")


def test_the_held_out_pass_samples_with_val_top_p() -> None:
    from verity.evaluation.validation import validation_sampling

    cfg = load_config(["rollout.val_temperature=0.7", "rollout.val_top_p=0.5", "rollout.top_p=0.9"])
    assert validation_sampling(cfg)["top_p"] == 0.5
    cfg = load_config(["rollout.val_temperature=0.7", "rollout.top_p=0.9"])
    assert validation_sampling(cfg)["top_p"] == 0.9
    cfg = load_config(["rollout.top_p=0.9"])  # greedy
    assert validation_sampling(cfg)["top_p"] == 1.0


def test_an_output_folder_that_cannot_be_made_is_named(tmp_path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        ([f"trainer.output_dir={a_file}"], "trainer.output_dir", "exists and is not a folder"),
        ([f"trainer.output_dir={a_file}/run"], "trainer.output_dir", "is a file, not a folder"),
        ([f"trainer.checkpoint.dir={a_file}"], "trainer.checkpoint.dir", "exists and is not a folder"),
    ]
    for overrides, key, words in cases:
        with pytest.raises(ConfigError) as err:
            load_config(overrides)
        assert key in str(err.value) and words in str(err.value)
    load_config([f"trainer.output_dir={tmp_path}/new/run"])  # a folder to be made: fine


def test_claiming_an_output_folder_that_cannot_be_made_is_a_config_error(tmp_path) -> None:
    import os

    from verity.launch.run_dir import claim_output_dir

    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    # root writes through permissions, but nothing makes a folder in /proc
    target = Path("/proc/verity-no-such-dir") if os.geteuid() == 0 else read_only / "run"
    try:
        with pytest.raises(ConfigError, match="trainer.output_dir .* cannot be created"), claim_output_dir(target):
            pass
    finally:
        read_only.chmod(0o700)


def test_sglang_on_a_machine_without_an_accelerator_is_refused_with_device_auto(monkeypatch) -> None:
    import verity.config.trainer_checks as checks

    monkeypatch.setattr(checks, "_local_device_is_cpu", lambda: True)
    with pytest.raises(ConfigError, match=r"this run's device is the CPU \(trainer.device=auto\)"):
        load_config(["rollout.engine=sglang"])
    # on a Ray cluster the workers find their own device: not judged from the driver's machine
    load_config(["rollout.engine=sglang", "trainer.ray_address=auto"])
    monkeypatch.setattr(checks, "_local_device_is_cpu", lambda: False)
    # as on a GPU machine with SGLang installed (without it: tests/unit/test_optional_packages.py)
    monkeypatch.setattr("verity.optional_packages.is_installed", lambda module: True)
    load_config(["rollout.engine=sglang"])


def test_a_gpu_config_names_every_placeholder_path_at_once() -> None:
    path = ROOT / "recipes/grpo/src/verity_recipe_grpo/configs/gsm8k-qwen2.5-0.5b.yaml"
    with pytest.raises(ConfigError) as err:
        load_config([], config_file=path)
    message = str(err.value)
    assert message.startswith("the config's placeholder paths must be replaced with your own")
    assert "model.path='/path/to/Qwen2.5-0.5B-Instruct'" in message
    assert "data.train_files=['/path/to/gsm8k/train.parquet']" in message and "data.val_files=" in message


def test_switching_engine_on_the_quickstart_preset_sets_its_fsdp2_tuning_aside(caplog) -> None:
    """Issue #49 finding 7: the preset's own actor.fsdp2 keys are not the user's, so they do not block."""
    import logging

    pytest.importorskip("megatron.core")
    from verity.cli.quickstart import preset_path

    overrides = ["actor.engine=megatron", "actor.megatron.tensor_parallel_size=2"]
    with caplog.at_level(logging.INFO, logger="verity.config"):
        cfg = load_config(overrides, config_file=preset_path(), preset=True)
    assert cfg.actor.engine == "megatron" and cfg.actor.megatron.tensor_parallel_size == 2
    aside = [r.getMessage() for r in caplog.records if "left aside" in r.getMessage()]
    assert len(aside) == 1
    assert "actor.engine=megatron: the quickstart preset's actor.fsdp2.* settings do not apply" in aside[0]
    # the same keys set by the user (on the command line) are still refused
    with pytest.raises(ConfigError, match="actor.fsdp2.micro_batch_tokens=1024"):
        load_config(
            [*overrides, "actor.fsdp2.micro_batch_tokens=1024"], config_file=preset_path(), preset=True
        )
    # a config file the user chose is theirs: its fsdp2 keys under another engine are refused
    with pytest.raises(ConfigError, match="actor.fsdp2.sharding='replicate'"):
        load_config(overrides, config_file=preset_path())


def test_verity_quickstart_with_another_engine_gets_past_the_config_check(monkeypatch) -> None:
    pytest.importorskip("megatron.core")
    import verity.cli.train as train

    seen = {}

    def fake_execute(cfg, prog, argv=None):
        seen["engine"] = cfg.actor.engine
        return 0, None

    monkeypatch.setattr(train, "execute", fake_execute)
    from verity.cli.quickstart import main

    assert main(["actor.engine=megatron", "actor.megatron.tensor_parallel_size=2"]) == 0
    assert seen["engine"] == "megatron"
