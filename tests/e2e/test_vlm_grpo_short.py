"""A verl-schema multimodal parquet (images as bytes) trains 2 GRPO steps with 2 workers through `verity train`."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def _png(value: int) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), (255, 255, 255))
    ImageDraw.Draw(image).rectangle((4, 4, 4 + 5 * value, 20), fill=(200, 30, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _with_images(rows: list[dict]) -> list[dict]:
    """The arithmetic task's rows with an image before each question (the verl multimodal schema)."""
    out = []
    for i, row in enumerate(rows):
        prompt = [dict(m) for m in row["prompt"]]
        prompt[-1]["content"] = "<image>" + prompt[-1]["content"]
        out.append(dict(row, prompt=prompt, images=[{"bytes": _png(i % 8), "path": None}]))
    return out


@pytest.mark.slow
def test_multimodal_parquet_trains_two_grpo_steps(tmp_path) -> None:
    from verity_toyworld.tasks.arithmetic import ArithmeticConfig, generate_splits
    from verity_toyworld.tiny_vlm import save_tiny_vlm

    model = save_tiny_vlm(tmp_path / "model")
    train_rows, test_rows = generate_splits(32, 8, 0, ArithmeticConfig(digits=1, style="expr"))
    files = {}
    for name, rows in (("train", train_rows), ("test", test_rows)):
        files[name] = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(_with_images(rows)), files[name])
    out = tmp_path / "run"
    args = [
        f"model.path={model}",
        f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['test']}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=4",
        "data.val_max_samples=8",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=4",
        "algorithm.kl.use_kl_loss=true",
        # an untrained model scores 0 everywhere (zero advantages): the entropy bonus gives the
        # update a gradient, through the decoder and the vision tower, to show the step trains
        "actor.entropy_coeff=0.01",
        "trainer.total_steps=2",
        "trainer.n_workers=2",
        "trainer.cpus_per_worker=0.5",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERITY_DEBUG_")}
    done = subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["actor/optimizer_steps"] >= 1.0
        assert row["actor/grad_norm"] > 0
        assert "reward/mean" in row and "timing/weight_sync_s" in row
    assert (out / "validation.jsonl").exists()
    # the final checkpoint exports to a folder that loads as the vision-language model it trained,
    # with its image processor
    from transformers import AutoImageProcessor, AutoModelForImageTextToText
    from verity.checkpoint.export import export_hf

    exported = export_hf(out, tmp_path / "hf")
    trained = AutoModelForImageTextToText.from_pretrained(exported)
    assert trained.config.model_type == "qwen2_5_vl"
    assert AutoImageProcessor.from_pretrained(exported).merge_size == 2
