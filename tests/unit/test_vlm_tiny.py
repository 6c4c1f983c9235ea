"""The tiny Qwen2.5-VL: builds from a config, saves and loads from its folder, trains on an image."""

from __future__ import annotations

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
from verity.data.multimodal import encode_image_prompt, image_token_id
from verity_toyworld.tiny_vlm import (
    IMAGE_PAD,
    VISION_TOKENS,
    build_tiny_qwen2_5_vl,
    build_vlm_image_processor,
    build_vlm_tokenizer,
    save_tiny_vlm,
)

MESSAGES = [{"role": "user", "content": "<image>How many?"}]


def _image(color: tuple[int, int, int] = (255, 0, 0)) -> Image.Image:
    return Image.new("RGB", (56, 56), color)


def test_tokenizer_has_the_vision_tokens_after_the_characters() -> None:
    tokenizer = build_vlm_tokenizer()
    assert len(tokenizer) == 264
    assert [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS] == [260, 261, 262, 263]
    assert tokenizer("a" + IMAGE_PAD + "b", add_special_tokens=False)["input_ids"] == [69, 262, 70]


def test_model_size_and_vision_tower() -> None:
    model = build_tiny_qwen2_5_vl(build_vlm_tokenizer())
    params = sum(p.numel() for p in model.parameters())
    assert 0.4e6 < params < 0.8e6, params
    assert len(model.model.visual.blocks) == 2
    assert model.config.image_token_id == 262


def test_forward_backward_on_one_56px_image(tmp_path) -> None:
    save_tiny_vlm(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    image_processor = AutoImageProcessor.from_pretrained(tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path)
    prompt = encode_image_prompt(MESSAGES, [_image()], tokenizer, image_processor)
    assert prompt.pixel_values.shape == (16, 1176)  # 4x4 patches of 3*2*14*14
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4]]
    ids = torch.tensor([prompt.input_ids])
    assert int((ids == image_token_id(tokenizer)).sum()) == 4  # 16 patches merged 2x2
    model.train()
    out = model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
        mm_token_type_ids=(ids == image_token_id(tokenizer)).int(),
        labels=ids,
    )
    assert torch.isfinite(out.loss)
    out.loss.backward()
    vision_grad = model.model.visual.blocks[0].attn.qkv.weight.grad
    assert vision_grad is not None and float(vision_grad.abs().sum()) > 0


def test_the_image_changes_the_logits() -> None:
    tokenizer = build_vlm_tokenizer()
    image_processor = build_vlm_image_processor()
    model = build_tiny_qwen2_5_vl(tokenizer).eval()
    logits = []
    for color in ((255, 0, 0), (0, 0, 255)):
        prompt = encode_image_prompt(MESSAGES, [_image(color)], tokenizer, image_processor)
        ids = torch.tensor([prompt.input_ids])
        with torch.no_grad():
            logits.append(
                model(
                    input_ids=ids,
                    pixel_values=prompt.pixel_values,
                    image_grid_thw=prompt.image_grid_thw,
                    mm_token_type_ids=(ids == 262).int(),
                ).logits[0, -1]
            )
    assert not torch.allclose(logits[0], logits[1])


def test_fsdp2_shards_the_vision_blocks_and_the_decoder_layers() -> None:
    from verity.engines.fsdp2 import decoder_layers

    model = build_tiny_qwen2_5_vl(build_vlm_tokenizer())
    names = sorted({type(m).__name__ for m in decoder_layers(model)})
    assert names == ["Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"]
    assert len(decoder_layers(model)) == 4  # 2 vision blocks + 2 decoder layers


def test_the_saved_folder_passes_the_model_check_and_loads(tmp_path) -> None:
    from verity.config.model_checks import check_model_folder
    from verity.engines.hf_loading import load_causal_lm

    save_tiny_vlm(tmp_path)
    assert check_model_folder("model.path", str(tmp_path))["model_type"] == "qwen2_5_vl"
    assert type(load_causal_lm(tmp_path)).__name__ == "Qwen2_5_VLForConditionalGeneration"
