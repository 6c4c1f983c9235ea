"""Where a role's HF model comes from, and how it is built: whole, or empty and filled shard by shard.

A :class:`ModelSource` names a local HF checkpoint folder and the model class a role
builds from it (a causal LM for the actor and reference, a token classifier with a
fresh scalar head for the critic, a one-label sequence classifier for the reward model).
It can

- :meth:`~ModelSource.load_whole`: the module with every weight, as ``from_pretrained``
  builds it (one process, replicated engines, engines that shard nothing);
- :meth:`~ModelSource.build_empty`: the module with its parameters on the ``meta``
  device (no storage) and its buffers real — what a sharding engine wraps before
  :func:`verity.engines.streamed_loading.fill_from_checkpoint` gives each rank its
  shard, read once by one rank (:mod:`verity.engines.streamed_loading`).

``streams`` says whether the second path applies to this folder: it needs the weights in
safetensors form under the names the module uses. Vision-language checkpoints are renamed
by transformers while loading, so they load whole; so are mixture-of-experts checkpoints,
whose files hold each expert apart and whose modules hold a layer's experts in one 3-D
tensor (``experts_stored_apart``: the Megatron engine reads those files itself,
:mod:`verity.engines.megatron.moe_files`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verity.data.multimodal import VISION_LANGUAGE_MODEL_TYPES
from verity.engines.hf_loading import quiet_loading
from verity.engines.safetensors_files import CheckpointError, CheckpointFiles, has_safetensors

__all__ = ["KINDS", "ModelSource", "parameters_on_meta"]

# what a role builds from the checkpoint: the transformers auto class and the config changes
KINDS = ("causal_lm", "value_model", "reward_model")
# mixture-of-experts models whose transformers module fuses the experts that their files keep apart
MERGED_EXPERT_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, every parameter a module registers lives on the ``meta`` device.

    Buffers are untouched, so those computed at construction (rotary frequencies) are
    real. Each parameter is created where its module makes it and moved at once, so at
    most one parameter's storage exists at a time.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass(frozen=True)
class ModelSource:
    """A role's model: the checkpoint folder ``path`` built as ``kind`` (one of :data:`KINDS`).

    ``dtype``: the parameters' dtype; ``attn_implementation``: the HF attention kernel
    (None: transformers' default). For ``value_model`` the scalar head ``score`` is not in
    the checkpoint and starts at zero (see :attr:`fresh_parameters`). A ``reward_model``
    (``AutoModelForSequenceClassification``, one label) reads its ``score`` head from the
    checkpoint when the safetensors files hold one; a plain causal-LM folder has none, and
    the head is then fresh like the critic's.
    """

    path: str
    kind: str = "causal_lm"
    dtype: torch.dtype = torch.float32
    attn_implementation: str | None = None
    # reward_model: whether the safetensors files lack the score head (read from their headers once)
    _head_missing: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ModelSource.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "reward_model" and has_safetensors(self.path):
            try:
                names = CheckpointFiles(self.path).names()
            except CheckpointError:
                return  # the loader names the broken file when it reads it
            missing = not any(name.startswith("score.") for name in names)
            object.__setattr__(self, "_head_missing", missing)

    # ------------------------------------------------------------------ facts
    def model_type(self) -> str | None:
        """``config.json``'s ``model_type`` (None when unreadable)."""
        try:
            return json.loads((Path(self.path) / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None

    @property
    def streams(self) -> bool:
        """Whether a sharding engine can build this model empty and fill it from the files directly."""
        return (
            has_safetensors(self.path)
            and self.model_type() not in VISION_LANGUAGE_MODEL_TYPES
            and not self.experts_stored_apart
        )

    @property
    def experts_stored_apart(self) -> bool:
        """Whether this is a mixture-of-experts folder whose files may hold each expert's weights apart
        (``mlp.experts.{e}.gate_proj.weight``) while the module fuses them (``mlp.experts.gate_up_proj``)."""
        return has_safetensors(self.path) and self.model_type() in MERGED_EXPERT_MODEL_TYPES

    @property
    def fresh_parameters(self) -> tuple[str, ...]:
        """Parameter-name prefixes the checkpoint does not hold; they start at zero."""
        return ("score.",) if self.kind == "value_model" or self._head_missing else ()

    # ------------------------------------------------------------- building
    def config(self) -> Any:
        """The folder's HF config (``num_labels=1``; no head dropout for a value model)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        if self.kind in ("value_model", "reward_model"):
            config.num_labels = 1
        if self.kind == "value_model":
            config.classifier_dropout = 0.0
        return config

    def _auto_class(self) -> Any:
        import transformers

        if self.kind == "value_model":
            return transformers.AutoModelForTokenClassification
        if self.kind == "reward_model":
            return transformers.AutoModelForSequenceClassification
        if self.model_type() in VISION_LANGUAGE_MODEL_TYPES:
            return transformers.AutoModelForImageTextToText
        return transformers.AutoModelForCausalLM

    def _extra(self) -> dict[str, Any]:
        return {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}

    def load_whole(self) -> nn.Module:
        """The module with every weight on CPU (``from_pretrained``; the value head zeroed)."""
        if not Path(self.path).is_dir():
            what = {"value_model": "critic model path", "reward_model": "reward model path"}.get(
                self.kind, "model path"
            )
            raise FileNotFoundError(f"{what} {self.path!r} is not a directory with an HF checkpoint")
        with quiet_loading():  # the value head is "missing" from a causal-LM checkpoint, as intended
            module = self._auto_class().from_pretrained(
                self.path, config=self.config(), dtype=self.dtype, local_files_only=True, **self._extra()
            )
        self._check_head(module)
        self._zero_fresh(module)
        return module

    def build_empty(self) -> nn.Module:
        """The module with parameters on ``meta`` and real buffers (:func:`parameters_on_meta`)."""
        with quiet_loading(), parameters_on_meta():
            module = self._auto_class().from_config(self.config(), dtype=self.dtype, **self._extra())
        self._check_head(module)
        return module

    def parameter_count(self) -> int:
        """Parameters of the model at full size (counted on an empty build: no weights read)."""
        return sum(p.numel() for p in self.build_empty().parameters())

    def _check_head(self, module: nn.Module) -> None:
        if self.kind == "causal_lm":
            return
        head = getattr(module, "score", None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            role = "a critic" if self.kind == "value_model" else "a reward model"
            raise TypeError(f"{type(module).__name__} has no scalar 'score' head; cannot use it as {role}")

    def _zero_fresh(self, module: nn.Module) -> None:
        if not self.fresh_parameters:
            return
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name.startswith(self.fresh_parameters):
                    param.zero_()
