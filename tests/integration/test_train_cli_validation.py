"""`verity train` refuses bad input before any worker starts: exit 2, naming rows, keys and folders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

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


def _fake_checkpoint(out, config: dict) -> None:
    """A complete step_3 checkpoint in ``out`` whose driver state says it ran ``config``."""
    from verity.checkpoint import layout
    from verity.checkpoint.state import TrainerState

    tmp = out / "checkpoints" / "step_3.tmp"
    tmp.mkdir(parents=True)
    TrainerState(
        step=3, total_steps=4, dataloader={}, kl_coef=None, run_id=None, tracking_uri=None,
        config_hash="h", config=config,
    ).write(tmp)  # fmt: skip
    layout.commit(tmp, out / "checkpoints" / "step_3")


def test_auto_resume_refuses_a_checkpoint_of_another_config_naming_the_keys(model_dir, tmp_path):
    from verity.config import config_to_dict, load_config

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(good_row(i)) + "\n" for i in range(4)))
    args = [f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{train}]",
            f"trainer.output_dir={tmp_path / 'out'}"]  # fmt: skip
    saved = config_to_dict(load_config([*args, "algorithm.advantage.estimator=grpo"]))
    _fake_checkpoint(tmp_path / "out", saved)
    done = verity_train(*args, "algorithm.advantage.estimator=rloo")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "algorithm.advantage.estimator: 'grpo' -> 'rloo'" in done.stderr
    assert "trainer.output_dir" in done.stderr and "trainer.resume=off" in done.stderr
    assert "Started a local Ray instance" not in done.stderr


def test_a_second_run_into_a_busy_output_folder_fails_at_once_naming_the_holder(model_dir, tmp_path):
    import os

    from verity.launch.run_dir import claim_output_dir

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(good_row(i)) + "\n" for i in range(4)))
    out = tmp_path / "out"
    with claim_output_dir(out):
        done = verity_train(f"model.path={model_dir}", f"data.train_files=[{train}]",
                            f"data.val_files=[{train}]", f"trainer.output_dir={out}")  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"in use by another run (pid {os.getpid()} on host" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == [".verity.lock"]  # nothing of the refused run was written


@pytest.mark.parametrize(
    ("extra", "sentence"),
    [
        (
            ["trainer.n_workers=2", "rollout.tensor_parallel_size=2"],
            "does not divide the model's 2 attention heads and 1 key/value heads",
        ),
        (
            ["trainer.n_workers=2", "rollout.engine=sglang", "rollout.tensor_parallel_size=2"],
            "rollout engine does not split the policy",
        ),
        (
            ["trainer.n_workers=2", "actor.fsdp2.ulysses_sequence_parallel_size=2"],
            "must divide the model's 2 attention heads and 1 key/value heads",
        ),
        (
            ["trainer.n_workers=3", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6",
             "actor.fsdp2.ulysses_sequence_parallel_size=2"],  # fmt: skip
            "must divide trainer.n_workers = 3: every SP group needs 2 whole ranks",
        ),
    ],
)
def test_a_rollout_split_that_cannot_run_stops_before_workers_start(model_dir, tmp_path, extra, sentence):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(good_row(i)) + "\n" for i in range(4)))
    done = verity_train(
        f"model.path={model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{train}]",
        f"trainer.output_dir={tmp_path / 'out'}",
        *extra,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert sentence in done.stderr
    assert "Started a local Ray instance" not in done.stderr


def test_a_token_budget_below_the_longest_row_stops_before_workers_start(model_dir, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(good_row(i)) + "\n" for i in range(4)))
    done = verity_train(
        f"model.path={model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{train}]",
        f"trainer.output_dir={tmp_path / 'out'}",
        "actor.fsdp2.micro_batch_tokens=100",
        "data.max_prompt_length=64",
        "data.max_response_length=64",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        "actor.fsdp2.micro_batch_tokens=100 is smaller than the longest row, data.max_prompt_length + "
        "data.max_response_length = 64 + 64 = 128 tokens; set it to at least 128, or 0 for rows only"
    ) in done.stderr
    assert "Started a local Ray instance" not in done.stderr
