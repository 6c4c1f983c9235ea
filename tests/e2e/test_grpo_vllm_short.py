"""A short GRPO run with rollout.engine=vllm: 2 Ray workers, each with FSDP2 and an in-process vLLM engine."""

from __future__ import annotations

import json

import pytest
from helpers.vllm_required import require_vllm
from verity.config import load_config

require_vllm()


@pytest.fixture(scope="module")
def vllm_model_and_task(tmp_path_factory) -> dict[str, str]:
    """The e2e task with a tiny model whose head size vLLM's CPU attention takes (32)."""
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tasks.arithmetic import ArithmeticConfig, write_splits
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    root = tmp_path_factory.mktemp("tiny_vllm")
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    files = write_splits(
        root / "data", num_train=96, num_test=32, seed=0, config=ArithmeticConfig(digits=1, style="expr")
    )
    return {
        "model": str(root / "model"),
        "train": str(files["train"]),
        "test": str(files["test"]),
        "root": str(root),
    }


def _run_grpo(paths: dict[str, str], tmp_path, *extra: str) -> tuple[dict, list[dict]]:
    """A 2-step GRPO run on 2 workers with the vLLM rollout; ``(summary, metrics rows)``."""
    from verity.launch.run import run_training

    out = tmp_path / "run"
    summary = run_training(
        load_config(
            [
                f"model.path={paths['model']}",
                f"data.train_files=[{paths['train']}]",
                f"data.val_files=[{paths['test']}]",
                "data.train_batch_size=8",
                "data.max_prompt_length=32",
                "data.max_response_length=6",
                "data.val_max_samples=32",
                "rollout.engine=vllm",
                "rollout.n=4",
                "rollout.vllm.kv_cache_bytes=33554432",
                f"rollout.vllm.cache_dir={tmp_path / 'vllm_cache'}",
                "actor.ppo_mini_batch_size=4",
                "actor.micro_batch_size=8",
                "actor.optim.lr=1e-3",
                "trainer.total_steps=2",
                "trainer.n_workers=2",
                "trainer.cpus_per_worker=0.5",
                "trainer.progress=false",
                f"trainer.output_dir={out}",
                *extra,
            ]
        )
    )
    assert summary["steps"] == 2
    recorded = json.loads((out / "summary.json").read_text())
    assert recorded["ran"]["rollout"] == "vllm"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["timing/weight_sync_s"] > 0
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    return summary, rows


@pytest.mark.slow
def test_grpo_with_vllm_rollout_on_two_workers(vllm_model_and_task, tmp_path) -> None:
    _run_grpo(vllm_model_and_task, tmp_path)


@pytest.mark.slow
def test_grpo_with_a_tensor_parallel_vllm_rollout_on_two_workers(vllm_model_and_task, tmp_path) -> None:
    """One vLLM replica over both workers (vLLM's external launcher over their gloo group); the weight
    sync sends every rank the full tensors."""
    _, rows = _run_grpo(vllm_model_and_task, tmp_path, "rollout.tensor_parallel_size=2")
    for row in rows:
        assert "perf/weight_sync_received_bytes" not in row  # full tensors to both ranks: nothing sliced
