"""The optional packages a config can ask for, checked before anything starts.

A setting that needs a package verity does not always install (or that an install may
lack) is refused at validation, before Ray starts, with one sentence naming the setting,
the package and the command that installs it::

    rollout.engine=vllm needs vLLM, which is not installed here: pip install 'verity[vllm]' ...

:data:`PACKAGES` holds each package (what is imported, its name, how to install it);
:func:`needed_packages` lists what a config asks for: ``actor.engine=megatron``
(megatron-core), LoRA (``actor.lora.rank > 0``: peft), a vision-language model (images:
Pillow), the rollout engine's own ``requires`` (declared where it is registered,
:func:`verity.rollout.register_rollout_engine`), and compiled layers and loss head on a
CUDA or ROCm device (``fsdp2.compile=true``: Triton kernels). A name an engine requires
that is not in :data:`PACKAGES` is imported under that name and installed with
``pip install <name>``.

The last two are imported by the workers only: they are checked here when the workers run
on this machine (a private Ray cluster); on a cluster (``trainer.ray_address``) the
rollout engine checks its own when a worker builds it, raising the same sentence as a
:class:`MissingPackageError` (exit 2, :func:`require`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verity.config.errors import ConfigError
from verity.optional_packages import (
    PACKAGES,
    MissingPackageError,
    OptionalPackage,
    is_installed,
    missing_package_sentence,
    require,
)

__all__ = [
    "PACKAGES",
    "MissingPackageError",
    "OptionalPackage",
    "check_optional_packages",
    "is_installed",
    "missing_package_sentence",
    "needed_packages",
    "require",
]


def needed_packages(cfg: Any) -> list[tuple[str, str]]:
    """``(setting, package name)`` for every optional package this config needs that this machine can check."""
    from verity.config.cluster_checks import cluster_address

    needs: list[tuple[str, str]] = []
    if cfg.actor.engine == "megatron":
        needs.append(("actor.engine=megatron", "megatron-core"))
    if cfg.actor.lora.enabled:  # the driver too: it checks the adapter targets with peft
        needs.append((f"actor.lora.rank={cfg.actor.lora.rank}", "peft"))
    images = _images_setting(cfg)
    if images is not None:  # the driver too: it reads the images of the prompts
        needs.append((images, "pillow"))
    if cluster_address(cfg):  # the workers run elsewhere: they check their own
        return needs
    needs += [
        (f"rollout.engine={cfg.rollout.engine}", name) for name in _rollout_requires(cfg.rollout.engine)
    ]
    needs += [(setting, "triton") for setting in _compiled_on_gpu(cfg)]
    return needs


def check_optional_packages(cfg: Any) -> None:
    """:class:`ConfigError` naming the setting, the package and its install command, for the first one missing."""
    for setting, name in needed_packages(cfg):
        sentence = missing_package_sentence(setting, name)
        if sentence is not None:
            raise ConfigError(sentence)


def _rollout_requires(engine: str) -> tuple[str, ...]:
    """What the rollout engine ``engine`` declared it imports (nothing for a name not registered)."""
    from verity.registry import UnknownNameError
    from verity.rollout.registry import ROLLOUT_ENGINES

    try:
        return tuple(ROLLOUT_ENGINES.get(engine).requires)
    except UnknownNameError:  # the engine checks name it, with the known names
        return ()


def _compiled_on_gpu(cfg: Any) -> list[str]:
    """``<section>.fsdp2.compile=true`` of the trained roles, when they run on this machine's CUDA or ROCm device.

    There inductor writes Triton kernels and the loss head runs verity's own
    (:mod:`verity.engines.triton_head`); on the CPU inductor writes C++ (checked with the engines).
    """
    from verity.config.derived import needs_critic

    sections = ["actor"] + (["critic"] if needs_critic(cfg) else [])
    compiled = [s for s in sections if getattr(cfg, s).engine == "fsdp2" and getattr(cfg, s).fsdp2.compile]
    device = str(cfg.trainer.device).strip().lower()
    if not compiled or device not in ("auto", "cuda", "gpu", "rocm", "hip") or not _local_gpu():
        return []
    return [
        f"{s}.fsdp2.compile=true (Triton kernels on trainer.device={cfg.trainer.device})" for s in compiled
    ]


def _local_gpu() -> bool:
    """Whether this machine's device is a CUDA or ROCm GPU."""
    from verity.hardware import detect_backend

    return detect_backend().name in ("cuda", "rocm")


def _images_setting(cfg: Any) -> str | None:
    """The setting that makes this a run with images (a vision-language model), or None."""
    from verity.data.multimodal import VISION_LANGUAGE_MODEL_TYPES

    if cfg.model.path == "embedded":
        from verity.data.embedded import embedded_preset

        try:
            preset = embedded_preset(cfg.model.embedded_preset)
        except ValueError:  # named by the preset check
            return None
        if preset.vision:
            return f"model.embedded_preset={cfg.model.embedded_preset} (a vision-language model, prompts with images)"
        return None
    try:
        config = json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # the model folder checks name what is wrong with it
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type in VISION_LANGUAGE_MODEL_TYPES:
        return f"model.path={cfg.model.path} (a {model_type} vision-language model, prompts with images)"
    return None
