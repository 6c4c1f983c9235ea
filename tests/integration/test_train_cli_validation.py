"""`verity train` refuses bad input before any worker starts: exit 2, naming rows, keys and folders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verity.data.char_tokenizer import CharTokenizer
    from verity.data.tiny_model import build_tiny_qwen2_for

    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=32)
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def good_row(i: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"{i}+1="}],
        "data_source": "verity/arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
    }


def verity_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_malformed_rows_are_listed_by_number_before_workers_start(model_dir, tmp_path):
    rows = [good_row(i) for i in range(6)]
    rows[2] = {"prompt": "not a chat list", "data_source": "verity/arithmetic", "reward_model": {}}
    rows[4]["data_source"] = ""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = verity_train(
        f"model.path={model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{train}]",
        f"trainer.output_dir={tmp_path / 'out'}",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "2 of 6 rows do not follow the verl schema" in done.stderr
    assert "row 2:" in done.stderr and "row 4:" in done.stderr
    assert "Started a local Ray instance" not in done.stderr


def test_resume_off_over_existing_checkpoints_is_refused(model_dir, tmp_path):
    step = tmp_path / "out" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(good_row(i)) + "\n" for i in range(4)))
    done = verity_train(
        f"model.path={model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{train}]",
        f"trainer.output_dir={tmp_path / 'out'}",
        "trainer.resume=off",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "trainer.resume=off" in done.stderr and "step_3" in done.stderr
