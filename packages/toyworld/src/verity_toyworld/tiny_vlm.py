"""A tiny Qwen2.5-VL vision-language model, its character tokenizer and its processor.

Everything is built from configs (nothing is downloaded) and saved in Hugging Face
format, so a folder written by :func:`save_tiny_vlm` loads the way a real
Qwen2.5-VL checkpoint does: ``Qwen2_5_VLForConditionalGeneration.from_pretrained``
(or ``AutoModelForImageTextToText``) for the model and ``AutoProcessor`` for the
processor (image processor + tokenizer + chat template).

Sizes (defaults): a 2-block vision tower (width 32, 2 heads, patch 14, 2x2 merge)
projects to a 2-layer text decoder (width 128, 4 query / 2 key-value heads, MLP 512)
over the 264-token vocabulary (the 260 character tokens of
:mod:`verity_toyworld.char_tokenizer` plus the four vision tokens) — about 0.6M
parameters. A 56x56 image is a 4x4 grid of 14-pixel patches, i.e. 16 patch rows of
``3 * 2 * 14 * 14 = 1176`` values in ``pixel_values`` and 4 image tokens in the prompt
after the 2x2 merge.

The chat template renders verl-style structured content: a message whose content is a
list of ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts becomes
``<|vision_start|><|image_pad|><|vision_end|>`` for each image and the text verbatim;
the processor then expands each ``<|image_pad|>`` to the image's token count.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import (
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from verity_toyworld.char_tokenizer import CharTokenizer

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS: tuple[str, ...] = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + VISION_START + IMAGE_PAD + VISION_END + "{% "
    "elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)
"""``<bos>`` then each message's content; image parts become the vision-token triple."""

# Images are resized so that height*width lies in [MIN_PIXELS, MAX_PIXELS] (multiples of 28).
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112


def build_vlm_tokenizer() -> CharTokenizer:
    """The character tokenizer plus the Qwen2.5-VL vision tokens (ids 260..263) and the VLM chat template."""
    tokenizer = CharTokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_vlm_image_processor() -> Any:
    """Qwen2-VL's Pillow image processor (patch 14, temporal patch 2, merge 2, ``MIN_PIXELS..MAX_PIXELS``)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def build_tiny_qwen2_5_vl(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    vision_intermediate: int = 64,
    max_pos: int = 512,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> Qwen2_5_VLForConditionalGeneration:
    """A randomly initialised float32 Qwen2.5-VL sized for ``tokenizer`` (see the module docstring).

    ``hidden``/``layers``/``heads``/``kv_heads``/``intermediate`` size the text decoder;
    ``vision_*`` the vision tower (its last block uses full attention, the others windowed
    attention, as in the released models). The M-RoPE sections split the text head's
    ``hidden/heads/2`` rotary frequencies between time, height and width. ``seed`` makes
    the initial weights reproducible without touching the global RNG.
    """
    head_dim = hidden // heads
    if hidden % heads or head_dim % 2:
        raise ValueError(
            f"heads: expected a divisor of hidden={hidden} giving an even head size, got {heads}"
        )
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}, got {kv_heads}")
    if vision_hidden % vision_heads:
        raise ValueError(
            f"vision_heads: expected a divisor of vision_hidden={vision_hidden}, got {vision_heads}"
        )
    half = head_dim // 2
    temporal = half - 2 * (half // 3)
    mrope_section = [temporal, half // 3, half // 3]
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    missing = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if missing:
        raise ValueError(f"tokenizer: the vision tokens {missing} are missing (use build_vlm_tokenizer)")
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate,
            "max_position_embeddings": max_pos,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": mrope_section,
            },
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "intermediate_size": vision_intermediate,
            "num_heads": vision_heads,
            "out_hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [vision_depth - 1],
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.to(torch.float32)
    return model


def save_tiny_vlm(path: str | os.PathLike, *, seed: int = 0) -> str:
    """Build the tiny model, tokenizer and processor and save all three into ``path``; returns ``path``."""
    tokenizer = build_vlm_tokenizer()
    model = build_tiny_qwen2_5_vl(tokenizer, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    build_vlm_image_processor().save_pretrained(path)
    return str(path)
