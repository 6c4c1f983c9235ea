"""The HF tensors a Megatron stage reads from a checkpoint folder: checked against the config, read on demand."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verity.engines.megatron import convert
from verity.engines.megatron.moe_files import ExpertTensors, expected_file_shapes
from verity.engines.model_source import ModelSource
from verity.engines.safetensors_files import CheckpointError, CheckpointFiles
from verity.engines.streamed_loading import TensorsOnDemand

__all__ = ["stage_tensors"]


def stage_tensors(source: ModelSource, shape: Any, dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
    """``source``'s tensors, read on demand in ``dtype``, after checking every shape against ``shape``.

    Raises :class:`~verity.engines.safetensors_files.CheckpointError` naming the first HF
    tensor the files lack or hold at another shape than the config gives.
    """
    files = CheckpointFiles(source.path)
    expected_shapes = convert.hf_shapes(shape)
    if shape.is_moe:  # experts may be stored one by one (save_pretrained's layout): moe_files
        expected_shapes = expected_file_shapes(expected_shapes, set(files.names()))
    for name, expected in expected_shapes.items():
        if name not in files:
            raise CheckpointError(
                f"{source.path}: the checkpoint has no tensor {name!r}; a shard is missing or the files "
                "belong to another architecture"
            )
        found = files.entries[name].shape
        if found != tuple(expected):
            raise CheckpointError(
                f"{source.path}: tensor {name!r} has shape {list(found)} in {files.entries[name].file.name}, "
                f"but the folder's config.json makes it {list(expected)}"
            )
    tensors = TensorsOnDemand(files, dtype)
    return ExpertTensors(tensors, shape.num_experts) if shape.is_moe else tensors
