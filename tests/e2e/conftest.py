"""Fixtures for end-to-end runs: a tiny model folder and arithmetic task files made locally."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_and_task(tmp_path_factory) -> dict[str, str]:
    """An untrained tiny Qwen2 + character tokenizer in HF format, and train/test parquet files."""
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tasks.arithmetic import ArithmeticConfig, write_splits
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    files = write_splits(
        root / "data", num_train=96, num_test=32, seed=0, config=ArithmeticConfig(digits=1, style="expr")
    )
    return {
        "model": str(model_dir),
        "train": str(files["train"]),
        "test": str(files["test"]),
        "root": str(Path(root)),
    }


@pytest.fixture
def tiny_grpo_overrides(tiny_model_and_task):
    """``overrides(out_dir, *extra)``: a 2-worker GRPO run on the tiny model and task (8 prompts x 4
    samples, 6 new tokens, one optimizer step a step), writing to ``out_dir``; ``extra`` last."""
    paths = tiny_model_and_task

    def overrides(out: str, *extra: str) -> list[str]:
        return [
            f"model.path={paths['model']}",
            f"data.train_files=[{paths['train']}]",
            f"data.val_files=[{paths['test']}]",
            "data.train_batch_size=8",
            "data.max_prompt_length=32",
            "data.max_response_length=6",
            "data.val_max_samples=16",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=8",
            "actor.optim.lr=1e-3",
            "trainer.total_steps=3",
            "trainer.n_workers=2",
            "trainer.cpus_per_worker=0.5",
            "trainer.progress=false",
            f"trainer.output_dir={out}",
            *extra,
        ]

    return overrides
