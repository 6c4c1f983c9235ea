"""Synthetic tasks: seeded generation, difficulty knobs, disjoint splits, verifiers (hand-checked cases)."""

from __future__ import annotations

import json
import pickle

import pytest
from verity.data.verl_dataset import check_rows
from verity_toyworld.tasks import TASKS, countdown, digit_sequence, gsm8k_style, multiply
from verity_toyworld.tasks._common import draw_rows

MY_TASKS = [gsm8k_style, countdown, digit_sequence, multiply]


@pytest.mark.parametrize("task", MY_TASKS)
def test_rows_are_verl_schema_seeded_and_registered(task):
    rows = task.generate(20, seed=5)
    assert check_rows(rows) == []
    assert all(r["data_source"] == task.DATA_SOURCE for r in rows)
    assert task.generate(20, seed=5) == rows
    assert task.generate(20, seed=6) != rows
    assert len({r["prompt"][0]["content"] for r in rows}) == 20  # distinct problems
    assert task in TASKS.values()


@pytest.mark.parametrize("task", MY_TASKS)
def test_splits_do_not_overlap(task):
    train, test = task.generate_splits(30, 10, seed=1)
    assert len(train) == 30 and len(test) == 10
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert not prompts(train) & prompts(test)
    assert {r["extra_info"]["split"] for r in test} == {"test"}


def test_gsm8k_style_reference_solutions_score_one():
    rows = gsm8k_style.generate(50, seed=0, steps=3, operations="+-*", max_value=30)
    for row in rows:
        assert gsm8k_style.score(row["extra_info"]["solution"], row["reward_model"]["ground_truth"]) == 1.0
        assert int(row["reward_model"]["ground_truth"]) >= 0


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("12 + 3 = 15\n#### 15", "15", 1.0),
        ("#### 1,500<eos>#### 3", "1500", 1.0),  # text after EOS is ignored
        ("#### 14", "15", 0.0),
        ("15", "15", 0.0),  # no marker
    ],
)
def test_gsm8k_style_verifier(response, truth, score):
    assert gsm8k_style.score(response, truth) == score


def test_countdown_problems_are_solvable_and_respect_knobs():
    rows = countdown.generate(40, seed=2, num_count=4, max_number=12, max_target=50)
    for row in rows:
        truth = json.loads(row["reward_model"]["ground_truth"])
        assert len(truth["numbers"]) == 4 and max(truth["numbers"]) <= 12 and 1 <= truth["target"] <= 50
        answer = f"<answer>{row['extra_info']['solution']}</answer>"
        assert countdown.score(answer, row["reward_model"]["ground_truth"]) == 1.0


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("<answer>(3 + 5) * 2</answer>", 1.0),
        ("<answer>2 * (5 + 3)</answer>", 1.0),
        ("<answer>3 * 5 + 1</answer>", 0.0),  # 1 is not given, 2 unused
        ("<answer>(3 + 5) * 2 * 1</answer>", 0.0),  # extra number
        ("<answer>8 * 2</answer>", 0.0),  # wrong numbers
        ("<answer>__import__('os')</answer>", 0.0),  # nothing but arithmetic is evaluated
        ("<answer>3 / (5 - 5) * 2</answer>", 0.0),  # division by zero
        ("<answer>1</answer> then <answer>(5 + 3) * 2</answer>", 1.0),  # last answer
        ("(3 + 5) * 2", 0.0),  # no tags
    ],
)
def test_countdown_verifier(response, score):
    truth = json.dumps({"target": 16, "numbers": [3, 5, 2]})
    assert countdown.score(response, truth) == score
    assert countdown.score(response, {"target": 16, "numbers": [3, 5, 2]}) == score  # verl-style dict


def test_digit_sequence_kinds_and_verifier():
    rows = digit_sequence.generate(
        40, seed=3, kinds=["arithmetic", "geometric", "repeat", "fibonacci"], predict=3
    )
    assert {r["extra_info"]["kind"] for r in rows} == {"arithmetic", "geometric", "repeat", "fibonacci"}
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert len(truth.split(",")) == 3
        assert digit_sequence.score(truth, truth) == 1.0
    assert digit_sequence.score("23, 27<eos>", "23, 27") == 1.0
    assert digit_sequence.score("The next terms are: 23 and 27\nAnswer: 23, 27", "23, 27") == 1.0
    assert digit_sequence.score("23, 28", "23, 27") == 0.0
    assert digit_sequence.score("", "23, 27") == 0.0


@pytest.mark.parametrize(
    ("factory", "knobs", "name"),
    [
        (gsm8k_style.GSM8KStyleConfig, {"steps": 0}, "steps"),
        (gsm8k_style.GSM8KStyleConfig, {"operations": "/"}, "operations"),
        (countdown.CountdownConfig, {"num_count": 9}, "num_count"),
        (digit_sequence.DigitSequenceConfig, {"kinds": ["primes"]}, "kinds"),
    ],
)
def test_bad_knobs_are_named(factory, knobs, name):
    with pytest.raises(ValueError, match=name):
        factory(**knobs)


def test_too_many_distinct_problems_is_an_error():
    with pytest.raises(ValueError, match="distinct"):
        digit_sequence.generate(5000, seed=0, kinds=["repeat"], shown=3, predict=1)


@pytest.mark.parametrize("task", MY_TASKS)
def test_task_generators_look_defined_in_the_task_module(task):
    config_class = next(v for k, v in vars(task).items() if k.endswith("Config") and isinstance(v, type))
    for function in (task.generate, task.generate_splits):
        assert function.__module__ == task.__name__ and function.__qualname__ == function.__name__
        assert config_class.__name__ in function.__doc__
        assert pickle.loads(pickle.dumps(function)) is function

    def draw(counts):
        draw_one = lambda rng: task.draw_problem(rng, config_class())  # noqa: E731
        return draw_rows(draw_one, counts, 7, task.DATA_SOURCE, task.ABILITY)

    splits = draw({"test": 4, "train": 6})
    assert task.generate_splits(6, 4, seed=7) == (splits["train"], splits["test"])
    assert task.generate(6, seed=7, split="val") == draw({"val": 6})["val"]


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("15846", 1.0),
        ("15846<eos>garbage", 1.0),
        ('<tool_call>{"name": "calculator"}</tool_call><tool_response>15846</tool_response>15846', 1.0),
        ("<tool_call>{}</tool_call><eos><tool_response>15846</tool_response>15846<eos>", 1.0),
        ("<tool_call>{}</tool_call><tool_response>15846</tool_response>", 0.0),  # no answer of its own
        ("<tool_call>{}</tool_call><tool_response>15846</tool_response>15847", 0.0),
        ('<tool_call>{"expression": "417*38"}</tool_call>', 0.0),  # a call nobody answered
        ("15846.", 0.0),
    ],
)
def test_multiply_verifier_reads_the_final_answer_after_the_tool(response, score):
    assert multiply.score(response, "15846") == score


def test_multiply_factors_have_the_configured_digits():
    for row in multiply.generate(50, seed=3, digits_a=4, digits_b=1):
        a, b = row["extra_info"]["expression"].split("*")
        assert len(a) == 4 and len(b) == 1
        assert row["reward_model"]["ground_truth"] == str(int(a) * int(b))
        assert row["prompt"][0]["content"] == f"{a}*{b}="
