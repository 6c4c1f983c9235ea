"""The seeded visual task: pictures of coloured shapes, a count question, a verifier."""

from __future__ import annotations

import io

from PIL import Image
from verity.data.verl_dataset import PromptDataset
from verity_toyworld.tasks import TASKS, task_for_data_source
from verity_toyworld.tasks.shape_count import COLOURS, DATA_SOURCE, ShapeCountConfig, generate_splits, score
from verity_toyworld.tiny_vlm import build_vlm_image_processor, build_vlm_tokenizer


def _count_colour(png: bytes, colour: str) -> int:
    """Shapes of ``colour`` counted from the pixels: cells whose centre has that colour."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(1 for cy in range(4) for cx in range(4) if image.getpixel((cx * 14 + 6, cy * 14 + 6)) == COLOURS[colour])


def test_splits_are_seeded_disjoint_and_the_answer_is_in_the_picture() -> None:
    train, test = generate_splits(40, 10, seed=3)
    again, _ = generate_splits(40, 10, seed=3)
    assert [r["images"][0]["bytes"] for r in train] == [r["images"][0]["bytes"] for r in again]
    keys = lambda rows: {(r["extra_info"]["colour"], r["extra_info"]["layout"]) for r in rows}  # noqa: E731
    assert not keys(train) & keys(test)
    for row in train + test:
        colour = row["extra_info"]["colour"]
        assert row["prompt"][0]["content"] == f"<image>{colour}?"
        assert _count_colour(row["images"][0]["bytes"], colour) == int(row["reward_model"]["ground_truth"])
    assert len({r["reward_model"]["ground_truth"] for r in train}) > 2  # answers vary


def test_verifier() -> None:
    assert score("3<eos>", "3") == 1.0
    assert score("3\nmore", 3) == 1.0
    assert score("4", "3") == 0.0 and score("three", "3") == 0.0


def test_registered_and_loads_as_multimodal_rows() -> None:
    assert TASKS["shape_count"] is task_for_data_source(DATA_SOURCE)
    train, _ = generate_splits(4, 1, seed=0, config=ShapeCountConfig(max_shapes=6))
    dataset = PromptDataset(train, build_vlm_tokenizer(), 32, image_processor=build_vlm_image_processor())
    assert all(r.image_grid_thw.tolist() == [[1, 4, 4]] for r in dataset.records)


def test_held_out_evaluation_scores_the_visual_task(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from verity.evaluation.held_out import evaluate_files
    from verity_toyworld.tiny_vlm import save_tiny_vlm

    model = save_tiny_vlm(tmp_path / "model")
    _, test = generate_splits(0, 6, seed=1)
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(test), path)
    report = evaluate_files(model, [str(path)], max_new_tokens=3, max_prompt_length=32, batch_size=4)
    assert report.prompts == 6 and report.responses == 6
    assert 0.0 <= report.mean_score <= 1.0
