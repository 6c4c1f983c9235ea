"""Checks of the model folders a config names, before any worker starts.

A folder given as ``model.path`` (or ``critic.model_path``) must be a Hugging Face
checkpoint folder whose ``config.json`` is a JSON object naming a ``model_type`` this
installation of ``transformers`` can build as a causal language model. Each problem
raises :class:`~verity.config.loader.ConfigError` naming the key, the file and what was
found, so that it never surfaces later as a worker error after Ray has started.
Paths still holding a recipe config's ``/path/to/...`` placeholder are named first, all
at once (:func:`reject_placeholders`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verity.config.errors import ConfigError


def _config_error(message: str) -> ConfigError:
    return ConfigError(message)


def causal_lm_model_types() -> set[str]:
    """``model_type`` values ``AutoModelForCausalLM`` can build in this installation of transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from verity.data.multimodal import VISION_LANGUAGE_MODEL_TYPES

    # plus the vision-language models whose image inputs verity builds (verity.data.multimodal)
    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(VISION_LANGUAGE_MODEL_TYPES)


def check_model_folder(key: str, path: str) -> dict[str, Any]:
    """Check one HF checkpoint folder; return its parsed ``config.json``.

    Raises ConfigError naming ``key`` (e.g. ``model.path``) when the folder or its
    ``config.json`` is missing, the file is not a JSON object, or its ``model_type`` is
    absent or unknown to transformers as a causal LM.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise _config_error(f"{key} {path!r} is not a local HF checkpoint folder")
    file = folder / "config.json"
    if not file.is_file():
        raise _config_error(f"{key} {path!r} has no config.json: not an HF checkpoint folder")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _config_error(f"{key}: {file} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise _config_error(f"{key}: {file} must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise _config_error(f"{key}: {file} has no 'model_type' (an HF config names its architecture there)")
    known = causal_lm_model_types()
    if model_type not in known:
        import transformers

        near = sorted(k for k in known if k[:3] == model_type[:3])[:8] or sorted(known)[:8]
        raise _config_error(
            f"{key}: {file} has model_type {model_type!r}, which transformers {transformers.__version__} "
            f"cannot build as a causal language model (similar known types: {near}); "
            "a newer transformers, or a model folder of a supported architecture, is needed"
        )
    return config


def check_checkpoint_files(key: str, path: str, kind: str = "causal_lm") -> None:
    """Check the weights of the checkpoint folder ``path`` against its ``config.json``, reading headers only.

    In safetensors form: the index parses and names only shards that exist, every header
    parses and fits its file, and (for a folder the engines stream,
    :attr:`~verity.engines.model_source.ModelSource.streams`) every parameter of the model
    the config builds has a tensor of its shape. ConfigError names ``key`` and the first
    problem. A folder of ``.bin`` weights is left to ``from_pretrained``.
    """
    from verity.engines.model_source import ModelSource
    from verity.engines.safetensors_files import CheckpointError, CheckpointFiles, has_safetensors
    from verity.engines.streamed_loading import check_checkpoint

    folder = str(Path(path).expanduser())
    if not has_safetensors(folder):
        return
    source = ModelSource(folder, kind)
    try:
        files = CheckpointFiles(folder)
        if source.streams:
            check_checkpoint(source.build_empty(), files, source)
    except CheckpointError as err:
        raise _config_error(f"{key}: {err}") from None


def check_model_folders(cfg: Any) -> None:
    """Check ``model.path`` (unless ``embedded``), ``critic.model_path`` and ``reward_model.model_path``
    (when set): config and weights."""
    if cfg.model.path != "embedded":
        check_model_folder("model.path", cfg.model.path)
        check_checkpoint_files("model.path", cfg.model.path)
    critic = getattr(cfg, "critic", None)
    critic_path = getattr(critic, "model_path", None)
    if critic_path:
        check_model_folder("critic.model_path", critic_path)
    if critic_path and getattr(critic, "enabled", False):
        check_checkpoint_files("critic.model_path", critic_path, "value_model")
    reward_model = getattr(cfg, "reward_model", None)
    rm_path = getattr(reward_model, "model_path", None)
    if rm_path and getattr(reward_model, "enabled", False):
        check_model_folder("reward_model.model_path", rm_path)
        check_checkpoint_files("reward_model.model_path", rm_path, "reward_model")


PLACEHOLDER = "/path/to/"  # how the GPU recipe configs mark the paths a user must give


def reject_placeholders(cfg: Any) -> None:
    """Every path key still holding a config's ``/path/to/...`` placeholder, named in one error."""
    keys = {
        "model.path": cfg.model.path,
        "model.tokenizer_path": cfg.model.tokenizer_path,
        "data.train_files": list(cfg.data.train_files),
        "data.val_files": list(cfg.data.val_files),
        "critic.model_path": cfg.critic.model_path,
        "reward_model.model_path": cfg.reward_model.model_path,
    }
    held = [
        f"{key}={value!r}"
        for key, value in keys.items()
        if any(str(v).startswith(PLACEHOLDER) for v in (value if isinstance(value, list) else [value]) if v)
    ]
    if held:
        raise ConfigError(
            "the config's placeholder paths must be replaced with your own (key=value overrides or your "
            "config file): " + ", ".join(held)
        )
