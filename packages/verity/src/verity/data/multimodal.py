"""Prompts with images, in verl's multimodal schema, turned into model inputs.

A multimodal row is an ordinary verl row plus an ``images`` column::

    {"prompt": [{"role": "user", "content": "<image>How many red shapes?"}],
     "images": [b"\\x89PNG...", ...],      # or {"bytes": ..., "path": ...} dicts, or file paths
     "data_source": ..., "reward_model": {"ground_truth": "3"}, ...}

Each ``<image>`` placeholder in the messages stands for the next image of the row, in
order; a row must hold exactly as many placeholders as images. The messages are turned
into structured content (``[{"type": "image"}, {"type": "text", "text": ...}]``, the form
Qwen2.5-VL chat templates render), the template is applied, and each image token
``<|image_pad|>`` the template wrote is repeated once per visual token of its image:
``t * h * w / merge_size**2`` for the image's patch grid ``(t, h, w)`` from the image
processor. The image processor (the model folder's ``AutoImageProcessor``) returns, per
row, ``pixel_values [sum of t*h*w over the row's images, C*T*P*P]`` and ``image_grid_thw
[images, 3]``; they are kept per row (never padded) and travel in the batch as the
per-sample keys ``pixel_values`` and ``image_grid_thw``.

Only the Qwen2-VL / Qwen2.5-VL token convention (``<|image_pad|>`` inside
``<|vision_start|>...<|vision_end|>``) is supported.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

IMAGE_PLACEHOLDER = "<image>"
IMAGE_TOKEN = "<|image_pad|>"
VISION_LANGUAGE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""``model_type`` values whose image inputs and M-RoPE positions verity builds (Qwen2-VL family)."""


def load_image_processor(model_path: str | os.PathLike) -> Any:
    """The model folder's ``AutoImageProcessor``, or None when it has no ``preprocessor_config.json``."""
    if not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_path), local_files_only=True)


@dataclass
class ImagePrompt:
    """One row's prompt with its images processed.

    ``input_ids``: the prompt's token ids with image tokens expanded; ``text``: the rendered
    prompt before expansion; ``pixel_values [N, C*T*P*P]`` float32; ``image_grid_thw
    [images, 3]`` int64.
    """

    input_ids: list[int]
    text: str
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def has_images_column(rows: Sequence[Any]) -> bool:
    """Whether any row carries a non-empty ``images`` value (the multimodal schema)."""
    return any(isinstance(r, Mapping) and r.get("images") is not None for r in rows)


def placeholder_count(messages: Sequence[Mapping[str, Any]]) -> int:
    """Number of ``<image>`` placeholders over all messages' string contents."""
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in messages)


def image_row_problems(row: Mapping[str, Any]) -> list[str]:
    """What is wrong with a row's ``images`` column (its shape, not the image bytes)."""
    images = row.get("images")
    if images is None:
        images = []
    if not isinstance(images, list | tuple):
        return [
            f"'images' must be a list of images (bytes, {{'bytes', 'path'}} or paths), got {type(images).__name__}"
        ]
    prompt = row.get("prompt")
    if not isinstance(prompt, list | tuple):
        return []  # the text checks report the prompt itself
    count = placeholder_count([m for m in prompt if isinstance(m, Mapping)])
    if count != len(images):
        return [
            f"the prompt has {count} '{IMAGE_PLACEHOLDER}' placeholders but 'images' holds {len(images)} images"
        ]
    return []


def load_image(value: Any) -> Any:
    """A PIL RGB image from raw bytes, a ``{"bytes", "path"}`` dict (HF datasets' Image), a path or a PIL image.

    Raises ValueError saying why the image cannot be read.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
        value = data if data is not None else path
        if value is None:
            raise ValueError("an image dict needs 'bytes' or 'path'")
    try:
        if isinstance(value, bytes | bytearray | memoryview):
            image = Image.open(io.BytesIO(bytes(value)))
        elif isinstance(value, str | os.PathLike):
            if not os.path.isfile(value):
                raise ValueError(f"image file {str(value)!r} does not exist")
            image = Image.open(value)
        else:
            raise ValueError(
                f"expected image bytes, a {{'bytes', 'path'}} dict or a path, got {type(value).__name__}"
            )
        image.load()
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"not a readable image ({type(error).__name__}: {error})") from None
    return image.convert("RGB")


def structured_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose ``<image>`` placeholders become ``{"type": "image"}`` parts (text kept in order).

    A message without placeholders keeps its plain string content.
    """
    out = []
    for message in messages:
        content = str(message["content"])
        if IMAGE_PLACEHOLDER not in content:
            out.append({"role": message["role"], "content": content})
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": message["role"], "content": parts})
    return out


def image_token_id(tokenizer: Any) -> int:
    """The id of ``<|image_pad|>``; ValueError when the tokenizer lacks it."""
    token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
        raise ValueError(
            f"tokenizer: has no {IMAGE_TOKEN!r} token; image prompts need a Qwen2-VL/Qwen2.5-VL tokenizer"
        )
    return int(token_id)


def encode_image_prompt(
    messages: Sequence[Mapping[str, Any]],
    images: Sequence[Any],
    tokenizer: Any,
    image_processor: Any,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ImagePrompt:
    """Render, process and tokenize one row (see the module docstring); ValueError on unreadable images."""
    pil_images = [load_image(v) for v in images]
    text = tokenizer.apply_chat_template(
        structured_messages(messages),
        tokenize=False,
        add_generation_prompt=True,
        **dict(chat_template_kwargs or {}),
    )
    if text.count(IMAGE_TOKEN) != len(pil_images):
        raise ValueError(
            f"the chat template wrote {text.count(IMAGE_TOKEN)} {IMAGE_TOKEN!r} tokens for {len(pil_images)} images"
        )
    if pil_images:
        processed = image_processor(images=pil_images, return_tensors="pt")
        pixel_values = processed["pixel_values"].float()
        grid = processed["image_grid_thw"].long()
    else:
        pixel_values = torch.zeros((0, 0), dtype=torch.float32)
        grid = torch.zeros((0, 3), dtype=torch.long)
    merge = int(getattr(image_processor, "merge_size", 2))
    pieces = text.split(IMAGE_TOKEN)
    expanded = pieces[0]
    for i, piece in enumerate(pieces[1:]):
        expanded += IMAGE_TOKEN * (int(grid[i].prod()) // merge**2) + piece
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    return ImagePrompt([int(i) for i in ids], text, pixel_values, grid)
