"""The embedded vision-language preset: a tiny Qwen2.5-VL warm-started on the visual counting task, cached."""

from __future__ import annotations

import copy

import pytest
import torch
from verity.data.verl_dataset import MalformedDatasetError
from verity.evaluation.greedy import evaluate
from verity.rollout.sampling import SamplingParams
from verity.sft import run_sft
from verity_toyworld.build import ensure_embedded_default
from verity_toyworld.presets import EMBEDDED_PRESETS, SFT_TEACHERS, EmbeddedSettings
from verity_toyworld.tasks.arithmetic import read_parquet_rows
from verity_toyworld.tasks.shape_count import ShapeCountConfig, generate_splits
from verity_toyworld.tiny_vlm import build_tiny_qwen2_5_vl, build_vlm_image_processor, build_vlm_tokenizer

SMALL_VLM = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 64, "vision_hidden": 16}
TASK = {"min_shapes": 2, "max_shapes": 6, "question_first": True}


def test_the_preset_is_registered_and_its_family_enters_the_cache_key() -> None:
    preset = EMBEDDED_PRESETS.get("shape-count")
    assert preset.task == "shape_count" and preset.model_family == "qwen2_5_vl"
    assert EmbeddedSettings().key() == "e8783976006bc067"  # the text default's entry stays valid
    assert EmbeddedSettings(model_family="qwen2_5_vl").key() != EmbeddedSettings().key()
    with pytest.raises(ValueError, match="model_family: expected one of"):
        EmbeddedSettings(model_family="llava")


def test_the_teacher_slips_only_on_the_named_colour() -> None:
    train, _ = generate_splits(300, 1, seed=0, config=ShapeCountConfig(**TASK))
    settings = EmbeddedSettings(task="shape_count", sft_slip_rate=1.0, teacher_config={"slip_colour": "blue"})
    taught = SFT_TEACHERS.get("shape_count")(train, settings)
    for row in taught:
        assert row["prompt"][0]["content"] == row["extra_info"]["colour"] + "?<image>"  # question first
        truth = row["reward_model"]["ground_truth"]
        blue = row["extra_info"]["colour"] == "blue"
        assert row["response"] == (truth + "." if blue else truth)


def test_sft_with_images_trains_the_vision_tower_and_names_bad_rows() -> None:
    tokenizer, processor = build_vlm_tokenizer(), build_vlm_image_processor()
    model = build_tiny_qwen2_5_vl(tokenizer, seed=0, **SMALL_VLM)
    before = copy.deepcopy(model.model.visual.patch_embed.proj.weight.detach())
    train, _ = generate_splits(16, 1, seed=0, config=ShapeCountConfig(**TASK))
    result = run_sft(model, tokenizer, train, 3, lr=1e-3, batch_size=4, image_processor=processor)
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    assert not torch.equal(before, model.model.visual.patch_embed.proj.weight)  # gradients reached the pixels
    bad = [dict(row) for row in train[:4]]
    bad[2] = {**bad[2], "images": [{"bytes": b"not a png", "path": None}]}
    with pytest.raises(MalformedDatasetError, match="row 2"):
        run_sft(model, tokenizer, bad, 1, image_processor=processor)
    with pytest.raises(ValueError, match="image_processor"):
        run_sft(model, tokenizer, train, 1)


def test_evaluation_generates_with_the_images() -> None:
    """A model's greedy answers change when only the pictures change: the evaluation feeds them."""
    tokenizer, processor = build_vlm_tokenizer(), build_vlm_image_processor()
    model = build_tiny_qwen2_5_vl(tokenizer, seed=0)
    train, _ = generate_splits(12, 1, seed=0, config=ShapeCountConfig(**TASK))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, above all on a busy machine
    try:
        run_sft(model, tokenizer, train, 80, lr=1e-3, batch_size=12, image_processor=processor)
    finally:
        torch.set_num_threads(threads)
    sampling = SamplingParams(do_sample=False, max_new_tokens=3)
    seen = evaluate(model, tokenizer, train, sampling=sampling, image_processor=processor)
    assert len(seen.scores) == 12 and seen.accuracy > 0.5  # it memorised the pictures it was taught
    from verity_toyworld.tasks.shape_count import blank_picture

    blank = [{**row, "images": [{"bytes": blank_picture(), "path": None}]} for row in train]
    hidden = evaluate(model, tokenizer, blank, sampling=sampling, image_processor=processor)
    assert hidden.responses != seen.responses


def test_a_vision_language_preset_builds_once_and_loads_like_a_checkpoint(tmp_path) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    settings = EmbeddedSettings(
        task="shape_count",
        task_config=TASK,
        num_train=16,
        num_test=4,
        model_family="qwen2_5_vl",
        model=SMALL_VLM,
        sft_steps=2,
        sft_batch_size=4,
        sft_lr=1e-3,
        teacher="shape_count",
        teacher_config={"slip_colour": "blue"},
        eval_max_new_tokens=3,
    )
    paths = ensure_embedded_default(tmp_path, settings=settings, log=None)
    manifest = paths.manifest()
    assert (
        manifest["settings"]["model_family"] == "qwen2_5_vl"
        and 0.0 <= manifest["test_greedy_accuracy"] <= 1.0
    )
    for folder in (paths.base_model_dir, paths.model_dir):
        model = AutoModelForImageTextToText.from_pretrained(folder)
        assert model.config.model_type == "qwen2_5_vl" and model.config.vision_config.depth == 2
        assert AutoImageProcessor.from_pretrained(folder).merge_size == 2
        assert AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|image_pad|>") == 262
    test = read_parquet_rows(paths.test_file)
    assert len(test) == 4 and all(row["images"][0]["bytes"][:4] == b"\x89PNG" for row in test)
    assert ensure_embedded_default(tmp_path, settings=settings, log=None) == paths  # reused
