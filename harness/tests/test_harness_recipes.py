"""Every recipe of the checkout: found, its configs load through verity's loader, its expected files parse."""

from __future__ import annotations

from pathlib import Path

import pytest
from verity_harness.expected import load_expected
from verity_harness.recipes import RecipeNotFoundError, find_recipe, list_recipes
from verity_harness.simulated_cluster import shape_to_simulate

REPO = Path(__file__).resolve().parents[2]
RECIPES = list_recipes(REPO)


def test_the_three_recipes_are_found() -> None:
    assert {"grpo", "ppo", "rloo"} <= set(RECIPES)
    with pytest.raises(RecipeNotFoundError, match="known: .*grpo"):
        find_recipe("nope", REPO)
    with pytest.raises(RecipeNotFoundError, match="no config 'gpu9'; known: cpu"):
        RECIPES["grpo"].config_path("gpu9")


def _placeholders(tmp_path: Path) -> list[str]:
    """Stand-ins for the files a GPU config expects the user to point at."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    data = []
    for split in ("train", "test"):
        path = tmp_path / f"{split}.parquet"
        path.write_bytes(b"")
        data.append(str(path))
    return [f"model.path={model}", f"data.train_files=[{data[0]}]", f"data.val_files=[{data[1]}]"]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_configs_load_and_expected_files_parse(name: str, tmp_path: Path) -> None:
    from verity.config import load_config

    recipe = RECIPES[name]
    configs = recipe.configs()
    assert "cpu" in configs
    for config, path in configs.items():
        cpu = config.startswith("cpu")  # cpu, cpu-megatron, cpu-vllm, ...: the embedded default on CPU
        overrides = [] if cpu else _placeholders(tmp_path)
        if shape_to_simulate(overrides, path) is not None:  # cpu-2node: the harness gives it a cluster
            overrides.append("trainer.ray_address=auto")
        cfg = load_config(overrides, config_file=path)
        assert cfg.trainer.total_steps > 0, config
        if cpu:
            assert cfg.model.path == "embedded", config
    assert recipe.expected_files(), f"{name} has no expected file"
    for path in recipe.expected_files():
        expected = load_expected(path)
        for config in expected.configs:
            assert config in configs, f"{path.name} names config {config!r} that {name} does not have"
    assert (recipe.folder.parents[1] / "README.md").is_file()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_gpu_configs_refuse_to_run_on_their_placeholders(name: str) -> None:
    from verity.config import ConfigError, load_config

    for config, path in RECIPES[name].configs().items():
        if config.startswith("cpu"):
            continue
        with pytest.raises(ConfigError, match=r"placeholder paths must be replaced .*model.path='/path/to/"):
            load_config([], config_file=path)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_package_finds_its_own_configs(name: str) -> None:
    import importlib

    recipe = RECIPES[name]
    module = importlib.import_module(recipe.package)
    assert name == module.NAME and module.PAPER
    assert module.config_path() == recipe.config_path("cpu")
    with pytest.raises(FileNotFoundError, match=r"no config 'gpu9' in .*configs; known: (\S+, )*cpu"):
        module.config_path("gpu9")
