"""The run config: Hydra composition, overrides, and validation before compute."""

from __future__ import annotations

import pytest
from verity.config import ConfigError, VerityConfig, config_to_dict, load_config


def test_defaults_compose_to_the_dataclass() -> None:
    cfg = load_config()
    assert isinstance(cfg, VerityConfig)
    assert cfg.algorithm.advantage.estimator == "grpo"
    assert cfg.actor.policy_loss.loss_agg_mode == "token-mean"


def test_overrides_reach_nested_fields() -> None:
    cfg = load_config(["actor.optim.lr=1e-5", "algorithm.advantage.estimator=rloo", "rollout.n=4"])
    assert cfg.actor.optim.lr == pytest.approx(1e-5)
    assert cfg.algorithm.advantage.estimator == "rloo"
    assert cfg.rollout.n == 4


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["actor.optim.lrr=1"], "lrr"),
        (["actor.optim.lr=abc"], "actor.optim.lr"),
        (["data.train_batch_size=30"], "actor.ppo_mini_batch_size (32 prompts)"),
        (["trainer.n_workers=3"], "32 x 8 = 256 rows does not divide over trainer.n_workers = 3"),
        (["rollout.n=0"], "rollout.n must be >= 1"),
        (["algorithm.advantage.estimator=nope"], "algorithm.advantage.estimator"),
        (["actor.policy_loss.name=nope"], "actor.policy_loss.name"),
        (["actor.policy_loss.loss_agg_mode=mean"], "loss_agg_mode"),
        (["actor.policy_loss.clip_ratio_c=0.5"], "clip_ratio_c"),
        (["data.truncation=cut"], "data.truncation"),
        (["data.train_files=[/no/such/file.parquet]"], "/no/such/file.parquet"),
        (["model.path=/no/such/model"], "model.path"),
        (["data.shuffle=2"], "data.shuffle must be true or false, got 2"),
        (["trainer.progress=maybe"], "trainer.progress must be true or false, got 'maybe'"),
        (["data.shuffle=null"], "data.shuffle must be true or false, got None"),
    ],
)
def test_bad_config_is_named(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert needle in str(err.value)


def test_unknown_algorithm_lists_known_names() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm.advantage.estimator=nope"])
    assert "grpo" in str(err.value) and "rloo" in str(err.value)


def test_config_file_and_overrides(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("defaults:\n  - verity\n  - _self_\nrollout:\n  n: 4\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(["trainer.total_steps=9"], config_file=path)
    assert (cfg.rollout.n, cfg.trainer.total_steps) == (4, 9)


def test_config_file_must_name_the_schema(tmp_path) -> None:
    path = tmp_path / "bare.yaml"
    path.write_text("rollout:\n  n: 4\n")
    with pytest.raises(ConfigError, match="defaults"):
        load_config(config_file=path)


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_file="/no/such.yaml")


def test_config_to_dict_is_plain() -> None:
    d = config_to_dict(load_config())
    assert d["actor"]["optim"]["lr"] == pytest.approx(3e-5)  # the embedded default's learning rate
    assert isinstance(d["data"]["train_files"], list)


def test_named_config_file_finds_a_yaml_or_names_the_known_ones(tmp_path) -> None:
    from verity.config import named_config_file

    (tmp_path / "cpu.yaml").write_text("trainer: {total_steps: 1}\n")
    (tmp_path / "big.yaml").write_text("trainer: {total_steps: 2}\n")
    assert named_config_file(tmp_path, "cpu") == tmp_path / "cpu.yaml"
    with pytest.raises(FileNotFoundError, match=r"no config 'gpu' in .*; known: big, cpu"):
        named_config_file(tmp_path, "gpu")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["actor.megatron.tensor_parallel_size=0"],
            "actor.megatron.tensor_parallel_size must be an int >= 1",
        ),
        (
            ["trainer.n_workers=2", "actor.megatron.tensor_parallel_size=4"],
            "trainer.n_workers = 2 is not a multiple of actor.megatron.tensor_parallel_size x "
            "pipeline_parallel_size = 4",
        ),
        (["algorithm.advantage.estimator=gae"], "runs with a critic are not supported yet"),
        (["model.gradient_checkpointing=true"], "does not recompute activations"),
        (["model.dtype=bfloat16"], "trains in float32 only"),
    ],
)
def test_megatron_engine_config_errors_are_named(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["actor.engine=megatron", *overrides])
    assert needle in str(err.value)


def test_megatron_engine_is_registered_without_values_or_adapters() -> None:
    from verity.engines import TRAINING_ENGINES

    spec = TRAINING_ENGINES.get("megatron")
    assert spec.trains_values is False and spec.supports_adapters is False
    cfg = load_config(
        ["actor.engine=megatron", "actor.megatron.tensor_parallel_size=2", "trainer.n_workers=2"]
    )
    assert cfg.actor.megatron.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="cannot train value models"):
        load_config(["critic.engine=megatron", "algorithm.advantage.estimator=gae"])


def test_a_bool_key_in_a_config_file_must_hold_a_bool(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("defaults:\n  - verity\n  - _self_\ndata:\n  shuffle: 0\n")
    with pytest.raises(ConfigError, match=r"data.shuffle must be true or false, got 0 \(config file\)"):
        load_config([], config_file=path)
    path.write_text("defaults:\n  - verity\n  - _self_\ndata:\n  shuffle: false\ncritic:\n  enabled: null\n")
    cfg = load_config(["trainer.progress=off"], config_file=path)
    assert (cfg.data.shuffle, cfg.critic.enabled, cfg.trainer.progress) == (False, None, False)


def test_a_single_data_file_is_a_list_of_one(tmp_path) -> None:
    train, val = tmp_path / "train.parquet", tmp_path / "my val.parquet"
    train.write_text("")
    val.write_text("")
    cfg = load_config([f"data.train_files={train}", f"data.val_files='{val}'"])
    assert cfg.data.train_files == [str(train)] and cfg.data.val_files == [str(val)]
    assert load_config([f"data.train_files=[{train},{train}]"]).data.train_files == [str(train)] * 2
    path = tmp_path / "mine.yaml"
    path.write_text(f"defaults: [verity, _self_]\ndata: {{train_files: {train}}}\n")
    with pytest.raises(ConfigError, match=r"data.train_files: a list is expected, .* train_files: \[/"):
        load_config([], config_file=path)


def test_real_checkpoints_get_verl_defaults_and_the_embedded_model_keeps_its_own(tmp_path, capsys) -> None:
    """A local model folder: verl's 512-token prompts and responses (a 75-token prompt fits), 200 steps;
    the embedded model: its own lengths and steps, as before, unless a key is set."""
    from verity.cli.main import main as verity

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    real = load_config([f"model.path={model}"])
    assert (real.data.max_prompt_length, real.data.max_response_length) == (512, 512)
    assert real.trainer.total_steps == 200
    assert verity(["config", "show", "data", f"model.path={model}"]) == 0
    shown = capsys.readouterr().out
    assert "  max_prompt_length: 512  # tokens" in shown and "  max_response_length: 512  # tokens" in shown
    for preset in ("default", "multiply-tools"):
        embedded = load_config([f"model.embedded_preset={preset}"])
        assert (embedded.data.max_prompt_length, embedded.data.max_response_length) == (48, 8)
        assert embedded.trainer.total_steps == 100
    assert load_config(["data.max_response_length=16"]).data.max_response_length == 16  # the user's key wins
