"""The toy world is a plug-in: the runtime reaches it only through its two registries."""

from __future__ import annotations

from importlib import metadata

import pytest
from verity.config import ConfigError, load_config
from verity.registry import Registry


def test_the_toy_world_is_declared_as_a_plug_in() -> None:
    specs = {ep.name: ep.value for ep in metadata.entry_points(group="verity.plugins")}
    assert specs.get("toyworld") == "verity_toyworld.plugin:register"


def test_its_tasks_and_presets_are_in_the_runtime_registries() -> None:
    from verity.data.embedded import EMBEDDED_PRESETS, EmbeddedModel, embedded_preset
    from verity.data.task_registry import synthetic_tasks, task_for_data_source

    tasks = synthetic_tasks()  # loads the plug-ins
    assert {"arithmetic", "countdown", "gsm8k_style", "multiply", "shape_count"} <= set(tasks.names())
    assert task_for_data_source("verity/arithmetic") is tasks.get("arithmetic")
    assert {"default", "multiply-tools", "shape-count"} <= set(EMBEDDED_PRESETS.names())
    default = embedded_preset("default")
    assert isinstance(default, EmbeddedModel)
    assert not default.vision and embedded_preset("shape-count").vision
    train, test = default.task_rows()
    assert len(train) == 6000 and len(test) == 500 and train[0]["data_source"] == "verity/arithmetic"


@pytest.fixture
def without_the_toy_world(monkeypatch):
    """The runtime as it is with no package providing embedded models or tasks."""
    from verity.data import embedded, task_registry

    monkeypatch.setattr(embedded, "EMBEDDED_PRESETS", Registry("embedded preset"))
    monkeypatch.setattr(task_registry, "TASKS", Registry("synthetic task"))
    monkeypatch.setattr("verity.plugins.load_plugins", lambda: [])


def test_without_it_model_path_embedded_names_the_package_to_install(without_the_toy_world) -> None:
    with pytest.raises(ConfigError, match=r"model\.embedded_preset: .*pip install -e packages/toyworld"):
        load_config([])  # model.path=embedded is the default


def test_without_it_data_synth_names_the_package_to_install(without_the_toy_world, tmp_path, capsys) -> None:
    from verity.cli.main import main as verity

    code = verity(["data", "synth", "--task", "arithmetic", "--n", "4", "--output", str(tmp_path / "d.parquet")])
    assert code == 1  # verity data's exit code for bad input (docs/failures.md)
    assert "no synthetic tasks are registered; install verity-toyworld" in capsys.readouterr().err


def test_a_plug_in_may_provide_its_own_embedded_model(monkeypatch, tmp_path) -> None:
    """Any object with the EmbeddedModel shape serves model.path=embedded (here: an HF folder on disk)."""
    from verity.data import embedded

    class Prebuilt:
        eval_max_new_tokens = 8
        vision = False
        config_preset = None  # the schema's defaults

        def check(self) -> None:
            pass

        def build(self, cache_dir, sft_steps=None):
            raise AssertionError("not built at config load")

        def fresh_model(self, seed=0):
            raise NotImplementedError

        def task_rows(self):
            raise NotImplementedError

    registry = Registry("embedded preset")
    monkeypatch.setattr(embedded, "EMBEDDED_PRESETS", registry)
    embedded.register_embedded_model("prebuilt", Prebuilt())
    assert load_config(["model.embedded_preset=prebuilt"]).model.embedded_preset == "prebuilt"
    with pytest.raises(TypeError, match="not an EmbeddedModel"):
        embedded.register_embedded_model("half", object())
    with pytest.raises(ConfigError, match="unknown embedded preset 'nope'; known embedded presets: prebuilt"):
        load_config(["model.embedded_preset=nope"])
