"""verl's multimodal schema: an `images` column with `<image>` placeholders, read unchanged."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from verity.batch.schema import validate
from verity.data.prompt_loader import PromptDataLoader, collate_prompts
from verity.data.verl_dataset import MalformedDatasetError, PromptDataset
from verity_toyworld.tiny_vlm import build_vlm_image_processor, build_vlm_tokenizer


def png(size: tuple[int, int] = (56, 56), color: tuple[int, int, int] = (0, 200, 0)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def row(content: str, images: list, answer: str = "1") -> dict:
    return {
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "data_source": "shapes",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train"},
    }


@pytest.fixture(scope="module")
def tokenizer():
    return build_vlm_tokenizer()


@pytest.fixture(scope="module")
def image_processor():
    return build_vlm_image_processor()


def test_parquet_with_image_bytes_loads_unchanged(tmp_path, tokenizer, image_processor) -> None:
    rows = [
        row("<image>count?", [{"bytes": png(), "path": None}]),
        row("<image><image>same?", [{"bytes": png((56, 112)), "path": None}, {"bytes": png(), "path": None}]),
        row("no image here", []),
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = PromptDataset(str(path), tokenizer, max_prompt_length=64, image_processor=image_processor)
    grids = [r.image_grid_thw.tolist() for r in dataset.records]
    assert grids == [[[1, 4, 4]], [[1, 8, 4], [1, 4, 4]], []]
    # variable image-token counts per row: 4, 8+4, 0
    counts = [r.input_ids.count(262) for r in dataset.records]
    assert counts == [4, 12, 0]
    batch = collate_prompts(dataset.records, dataset.pad_token_id)
    assert [p.shape[0] for p in batch["pixel_values"]] == [16, 48, 0]  # patches, not padded
    validate(batch)
    # the keys follow the rows through indexing and splitting
    part = batch.index([1])
    assert part["image_grid_thw"][0].tolist() == [[1, 8, 4], [1, 4, 4]]
    loader = PromptDataLoader(dataset, 2, shuffle=False)
    assert len(loader.next_batch()["pixel_values"]) == 2


def test_image_paths_load(tmp_path, tokenizer, image_processor) -> None:
    file = tmp_path / "a.png"
    file.write_bytes(png())
    dataset = PromptDataset([row("<image>?", [str(file)])], tokenizer, 64, image_processor=image_processor)
    assert dataset.records[0].pixel_values.shape == (16, 1176)


def test_placeholder_count_mismatch_names_the_row(tokenizer, image_processor) -> None:
    rows = [row("<image>ok", [png()]), row("<image><image>two", [png()]), row("none", [png()])]
    with pytest.raises(MalformedDatasetError) as error:
        PromptDataset(rows, tokenizer, 64, image_processor=image_processor)
    message = str(error.value)
    assert "row 1: the prompt has 2 '<image>' placeholders but 'images' holds 1" in message
    assert "row 2: the prompt has 0" in message
    assert "row 0" not in message


def test_unreadable_image_names_the_row(tmp_path, tokenizer, image_processor) -> None:
    rows = [
        row("<image>ok", [png()]),
        row("<image>bad", [b"not an image"]),
        row("<image>gone", [str(tmp_path / "missing.png")]),
    ]
    with pytest.raises(MalformedDatasetError) as error:
        PromptDataset(rows, tokenizer, 64, image_processor=image_processor)
    message = str(error.value)
    assert "row 1: 'images': not a readable image" in message
    assert "row 2: 'images': image file" in message and "does not exist" in message
    skipped = PromptDataset(rows, tokenizer, 64, image_processor=image_processor, on_malformed="skip")
    assert [r.row for r in skipped.records] == [0]


def test_images_without_an_image_processor_are_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="no image processor"):
        PromptDataset([row("<image>x", [png()])], tokenizer, 64)


def test_truncation_that_would_cut_image_tokens_is_refused(tokenizer, image_processor) -> None:
    with pytest.raises(ValueError, match="cut image tokens"):
        PromptDataset(
            [row("<image>x", [png()])],
            tokenizer,
            64,
            truncation="truncate_left",
            image_processor=image_processor,
        )


def test_text_rows_are_unchanged(tokenizer) -> None:
    dataset = PromptDataset(
        [
            {
                "prompt": [{"role": "user", "content": "2+3="}],
                "data_source": "d",
                "reward_model": {"ground_truth": "5"},
            }
        ],
        tokenizer,
        16,
    )
    assert dataset.records[0].pixel_values is None
    batch = collate_prompts(dataset.records, dataset.pad_token_id)
    assert "pixel_values" not in batch
    assert torch.equal(batch["attention_mask"], torch.ones_like(batch["input_ids"]))
