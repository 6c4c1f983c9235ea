"""The arithmetic task the warm-start trains on: generation, splits, verifier, parquet."""

from __future__ import annotations

import random
import re

import pytest
from verity_toyworld.tasks import TASKS, task_for_data_source
from verity_toyworld.tasks.arithmetic import (
    ArithmeticConfig,
    Problem,
    count_distinct_problems,
    draw_problem,
    extract_answer,
    generate,
    generate_splits,
    read_parquet_rows,
    render_prompt,
    score,
    write_splits,
)


def test_problem_rendering():
    problem = Problem((23, 14, 5), ("+", "-"), 32)
    assert problem.expression == "23+14-5"
    assert render_prompt(problem, "expr", random.Random(0)) == "23+14-5="
    word = render_prompt(problem, "word", random.Random(0))
    assert re.fullmatch(r"[A-Z][a-z]+ has 23 [a-z]+, gets 14, loses 5\. Now\? ", word), word


def test_draws_evaluate_left_to_right_and_stay_non_negative():
    rng = random.Random(1)
    config = ArithmeticConfig(digits=2, operands=4)
    for _ in range(300):
        problem = draw_problem(rng, config)
        total = problem.numbers[0]
        for op, number in zip(problem.operators, problem.numbers[1:], strict=True):
            total = total + number if op == "+" else total - number
            assert total >= 0
            assert 0 <= number <= 99
        assert total == problem.answer
    only_plus = ArithmeticConfig(operations="+")
    assert all(draw_problem(rng, only_plus).operators == ("+",) for _ in range(50))


def test_rows_follow_the_verl_schema():
    train, test = generate_splits(5, 3, seed=0, config=ArithmeticConfig(style="expr"))
    row = train[0]
    assert set(row) == {"prompt", "data_source", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "verity/arithmetic" and row["ability"] == "math"
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].endswith("=")
    expression = row["extra_info"]["expression"]
    assert row["prompt"][0]["content"] == expression + "="
    assert row["reward_model"] == {"style": "rule", "ground_truth": str(eval(expression))}
    assert [r["extra_info"]["split"] for r in test] == ["test"] * 3
    assert [r["extra_info"]["index"] for r in train] == [0, 1, 2, 3, 4]


def test_splits_are_disjoint_seeded_and_distinct():
    config = ArithmeticConfig(digits=1, operations="+")  # only 100 distinct problems
    train, test = generate_splits(60, 20, seed=4, config=config)
    train_exprs = {r["extra_info"]["expression"] for r in train}
    test_exprs = {r["extra_info"]["expression"] for r in test}
    assert len(train_exprs) == 60 and len(test_exprs) == 20 and not train_exprs & test_exprs
    again = generate_splits(60, 20, seed=4, config=config)
    assert again == (train, test)
    assert generate_splits(60, 20, seed=5, config=config) != (train, test)
    assert count_distinct_problems(config) == 100
    assert count_distinct_problems(ArithmeticConfig(digits=1)) == 100 + 55
    with pytest.raises(ValueError, match="distinct problems"):
        generate_splits(80, 20, seed=0, config=config)
    assert generate(20, seed=4, split="test", digits=1, operations="+") == test


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("37", "37", 1.0),
        ("37<eos>", "37", 1.0),
        (" 37 \nthe rest is ignored", "37", 1.0),
        ("-4", "-4", 1.0),
        ("037", "37", 1.0),  # the same integer
        ("370", "37", 0.0),
        ("3 7", "37", 0.0),
        ("37 apples", "37", 0.0),  # nothing but the integer before EOS/newline
        ("", "37", 0.0),
        ("<eos>37", "37", 0.0),
        ("36", 37, 0.0),
    ],
)
def test_verifier(response, truth, expected):
    assert score(response, truth) == expected


def test_verifier_rejects_a_bad_ground_truth_and_extracts():
    assert extract_answer("12<eos>junk") == "12"
    assert extract_answer("twelve") is None
    with pytest.raises(ValueError, match="ground_truth"):
        score("12", "twelve")


def test_registry_and_parquet_round_trip(tmp_path):
    assert TASKS["arithmetic"] is task_for_data_source("verity/arithmetic")
    with pytest.raises(KeyError, match="no synthetic task"):
        task_for_data_source("nope/none")
    paths = write_splits(tmp_path, num_train=30, num_test=10, seed=2)
    train, test = generate_splits(30, 10, seed=2)
    assert read_parquet_rows(paths["train"]) == train
    assert read_parquet_rows(paths["test"]) == test


def test_bad_knobs_raise():
    with pytest.raises(ValueError, match="digits"):
        ArithmeticConfig(digits=0)
    with pytest.raises(ValueError, match="operations"):
        ArithmeticConfig(operations="*")
    with pytest.raises(ValueError, match="operands"):
        ArithmeticConfig(operands=1)
    with pytest.raises(ValueError, match="style"):
        ArithmeticConfig(style="poem")
