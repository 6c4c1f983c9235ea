"""Built-in reward functions and the dispatch table (hand-computed scores)."""

from __future__ import annotations

import pytest
from verity.rewards import builtin
from verity.rewards.registry import (
    DEFAULT_REWARD_TABLE,
    RewardResultError,
    UnknownDataSourceError,
    call_reward,
    load_reward_function,
    normalize_result,
    resolve_spec,
)


@pytest.mark.parametrize(
    ("function", "response", "truth", "score"),
    [
        ("gsm8k_strict", "She has 18.\n#### 18", "18", 1.0),
        ("gsm8k_strict", "#### 1,234", "1234", 1.0),
        ("gsm8k_strict", "#### $72.00", "72", 1.0),
        ("gsm8k_strict", "The answer is 18", "18", 0.0),  # flexible would accept, strict not
        ("gsm8k_strict", "#### 17", "18", 0.0),
        ("gsm8k_flexible", "The answer is 18", "18", 1.0),
        ("gsm8k_flexible", "18 eggs... no wait, 19", "18", 0.0),  # last number wins
        ("gsm8k_flexible", "no answer", "18", 0.0),
        ("math_boxed", "so \\boxed{\\frac12}", "0.5", 1.0),
        ("math_boxed", "so \\boxed{\\frac{1}{2}}", "\\boxed{\\frac12}", 1.0),
        ("math_boxed", "so \\boxed{3}", "4", 0.0),
        ("math_boxed", "0.5", "0.5", 0.0),  # no box, no answer
        ("math_verify", "thus $\\boxed{\\frac12}$", "0.5", 1.0),
        ("math_verify", "thus $\\boxed{(x-1)(x+1)}$", "x^2-1", 1.0),  # symbolic
        ("math_verify", "thus $\\boxed{x+1}$", "x^2-1", 0.0),
        ("math_verify", "I do not know", "3", 0.0),
        ("dapo", "work\nAnswer: 42", "42", 1.0),
        ("dapo", "work\nAnswer: $\\frac{1}{2}$", "0.5", 1.0),
        ("dapo", "work\nAnswer: 41", "42", -1.0),  # DAPO scores wrong answers -1
        ("dapo", "the answer is 42", "42", -1.0),
        ("aime", "so \\boxed{033}", "33", 1.0),
        ("aime", "Answer: 204", "204", 1.0),
        ("aime", "Answer: 205", "204", 0.0),
        ("aime", "204", "204", 0.0),  # no recognised format
    ],
)
def test_builtin_scores(function, response, truth, score):
    result = builtin.BUILTIN_REWARD_FUNCTIONS[function]("any", response, truth)
    assert result["score"] == score
    assert result["acc"] == (1.0 if score == 1.0 else 0.0)


def test_builtin_pred_is_the_extracted_answer():
    assert builtin.gsm8k_strict("openai/gsm8k", "#### 1,000", "1000")["pred"] == "1000"
    assert builtin.math_boxed("math", "\\boxed{x}", "x")["pred"] == "x"
    assert builtin.aime("aime", "nothing", "3")["pred"] is None


def test_aime_rejects_non_integer_ground_truth():
    with pytest.raises(ValueError, match="ground_truth"):
        builtin.aime("aime", "\\boxed{1}", "1/2")


@pytest.mark.parametrize(
    ("source", "spec"),
    [
        ("openai/gsm8k", "gsm8k_strict"),
        ("lighteval/MATH", "math_boxed"),
        ("HuggingFaceH4/MATH-500", "math_boxed"),
        ("math_dapo", "dapo"),
        ("aime2024", "aime"),
        ("numina_olympiads", "math_verify"),
        ("codecontests", "code_sandbox"),
    ],
)
def test_default_dispatch(source, spec):
    assert resolve_spec(source) == spec


def test_dispatch_order_custom_then_overrides_then_table():
    assert resolve_spec("openai/gsm8k", {"openai/gsm8k": "gsm8k_flexible"}) == "gsm8k_flexible"
    assert resolve_spec("openai/gsm8k", {"openai/gsm8k": "x"}, "/f.py:fn") == "/f.py:fn"
    assert resolve_spec("mine", {"mine": "math_verify"}) == "math_verify"


def test_unknown_data_source_names_it():
    with pytest.raises(UnknownDataSourceError, match="'no_such_source'"):
        resolve_spec("no_such_source")


def test_synthetic_tasks_resolve_through_the_task_registry():
    spec = resolve_spec("verity/countdown")
    assert spec == "task:countdown"
    score, _ = call_reward(
        spec, "verity/countdown", "<answer>(2+3)*4</answer>", '{"target": 20, "numbers": [2, 3, 4]}'
    )
    assert score == 1.0


def test_every_table_entry_loads():
    for spec in set(DEFAULT_REWARD_TABLE.values()):
        assert callable(load_reward_function(spec))


def test_user_function_from_file_sync_async_and_dict(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "import asyncio\n"
        "def exact(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return float(solution_str.strip() == ground_truth) + bonus\n"
        "async def exact_async(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    await asyncio.sleep(0)\n"
        "    return {'score': 0.5, 'length': len(solution_str)}\n"
    )
    assert call_reward(f"{path}:exact", "d", " ok ", "ok", None, {"bonus": 0.25}) == (1.25, {})
    assert call_reward(f"{path}:exact_async", "d", "abc", "x") == (0.5, {"length": 3})


def test_user_function_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_reward_function(f"{tmp_path}/missing.py:fn")
    path = tmp_path / "r.py"
    path.write_text("def other(**kw):\n    return 1.0\n")
    with pytest.raises(AttributeError, match="has no function 'nope'"):
        load_reward_function(f"{path}:nope")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, (1.0, {})), (True, (1.0, {})), (0.25, (0.25, {})), ({"score": 2, "acc": 1}, (2.0, {"acc": 1}))],
)
def test_normalize_result(value, expected):
    assert normalize_result(value) == expected


@pytest.mark.parametrize("value", ["1.0", None, {"acc": 1}, float("nan"), [1.0]])
def test_normalize_result_rejects_non_scores(value):
    with pytest.raises(RewardResultError):
        normalize_result(value)
