"""Files in the verl schema of DAPO-Math-17k and AIME 2024 load, score and evaluate unchanged."""

from __future__ import annotations

import pytest
from dapo_data import INSTRUCTION, dapo_math_row, write_rows
from verity.data.verl_dataset import PromptDataset
from verity.rewards.registry import call_reward, resolve_spec
from verity_toyworld.char_tokenizer import CharTokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dapo-data")
    train = [dapo_math_row("What is 17 + 17?", "34"), dapo_math_row("Find $x$ if $2x = 10$.", "5")]
    aime = [
        dapo_math_row("AIME problem 1", "204"),
        dapo_math_row("AIME problem 2", "25", data_source="aime2024"),
    ]
    return write_rows(train, root / "dapo-math-17k.parquet"), write_rows(aime, root / "aime-2024.parquet")


def test_the_files_load_with_the_prompt_and_answer_as_written(files):
    tokenizer = CharTokenizer()
    train = PromptDataset([files[0]], tokenizer, max_prompt_length=400)
    record = train[0]
    assert record.data_source == "math_dapo" and record.ground_truth == "34"
    assert record.prompt_text.endswith(INSTRUCTION.format(problem="What is 17 + 17?"))
    aime = PromptDataset([files[1]], tokenizer, max_prompt_length=400)
    assert [aime[i].data_source for i in range(2)] == ["math_dapo", "aime2024"]


@pytest.mark.parametrize(
    "source, response, truth, score, acc",
    [
        ("math_dapo", "17 + 17 = 34.\nAnswer: 34", "34", 1.0, 1.0),  # DAPO's +1
        ("math_dapo", "I think it is 35.\nAnswer: 35", "34", -1.0, 0.0),  # DAPO's -1
        ("math_dapo", "the answer is 34", "34", -1.0, 0.0),  # no Answer: line
        ("math_dapo", "Answer: $204$", "204", 1.0, 1.0),
        ("aime2024", "so\nAnswer: 025", "25", 1.0, 1.0),  # the AIME verifier: integers, 1 / 0
        ("aime2024", "Answer: 26", "25", 0.0, 0.0),
    ],
)
def test_the_rows_are_scored_by_their_data_source(source, response, truth, score, acc):
    got, extra = call_reward(resolve_spec(source), source, response, truth)
    assert (got, extra["acc"]) == (score, acc)


def test_verity_eval_reports_avg_and_pass_at_k_on_the_aime_file(files, tmp_path):
    from verity.evaluation.held_out import evaluate_files
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(
        tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_pos=512
    )
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    report = evaluate_files(
        str(tmp_path / "m"), [files[1]], k=4, temperature=1.0, max_new_tokens=4, max_prompt_length=400
    )
    assert report.prompts == 2 and report.responses == 8
    names = {"val/k", "val/avg_at_k", "val/pass_at_k", "val/math_dapo/avg_at_k", "val/aime2024/pass_at_k"}
    assert names <= set(report.metrics) and report.metrics["val/k"] == 4.0
