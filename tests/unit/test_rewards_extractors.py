"""Answer extraction and math answer equality, table-driven (hand-written expected values)."""

from __future__ import annotations

import pytest
from verity.rewards.extractors import (
    clean_number,
    extract_boxed,
    extract_dapo_answer,
    extract_gsm8k_strict,
    extract_integer_answer,
    extract_last_number,
    parse_integer,
)
from verity.rewards.math_normalize import math_answers_equal, normalize_math_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has 18 eggs.\n#### 18", "18"),
        ("#### 1,234", "1234"),  # thousands comma
        ("#### $42", "42"),  # dollar sign
        ("####-7", "-7"),  # negative, no space
        ("#### 3.50", "3.50"),
        ("first #### 5 then #### 6", "6"),  # the last marker wins
        ("The answer is 18.", None),  # no marker: strict gives nothing
        ("", None),
        ("#### .5", "0.5"),
        ("#### 12.", "12"),  # trailing period of the sentence
    ],
)
def test_gsm8k_strict(text, expected):
    assert extract_gsm8k_strict(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She pays $1,234.50 in total.", "1234.50"),
        ("3 apples and 4 pears make 7.", "7"),
        ("The answer is -12", "-12"),
        ("no digits here", None),
        ("values 1,2,3", "3"),  # a list, not a thousands number
        ("#### 72", "72"),
        ("it costs $ 5", "5"),
    ],
)
def test_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("So $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{3} then \\boxed{4}", "4"),  # last match
        ("\\boxed{ 10 }", "10"),
        ("answer \\fbox{7}", "7"),
        ("\\boxed 5$", "5"),  # \boxed without braces
        ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
        ("\\boxed{unclosed", None),
        ("no box here", None),
    ],
)
def test_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Work...\nAnswer: 42", "42"),
        ("answer: 1\nAnswer: $\\frac{3}{4}$", "$\\frac{3}{4}$"),  # case-insensitive, last one
        ("Answer:\n", None),  # empty answer line
        ("The final answer is 5", None),
    ],
)
def test_dapo_answer(text, expected):
    assert extract_dapo_answer(text) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("033", 33),
        ("1,000", 1000),
        ("$42$", 42),
        ("7.0", 7),
        ("\\boxed{204}", 204),
        ("3.5", None),
        ("x", None),
    ],
)
def test_parse_integer(value, expected):
    assert parse_integer(value) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("\\boxed{033}", "33"), ("Answer: 204", "204"), ("\\boxed{\\frac12}", None), ("nothing", None)],
)
def test_integer_answer(text, expected):
    assert extract_integer_answer(text) == expected


def test_clean_number():
    assert clean_number("$1,234.50") == "1234.50"
    assert clean_number("-.5") == "-0.5"
    assert clean_number("7.") == "7"


@pytest.mark.parametrize(
    ("prediction", "reference", "equal"),
    [
        ("\\frac12", "0.5", True),  # LaTeX shorthand vs decimal
        ("\\boxed{\\frac12}"[7:-1], "1/2", True),
        ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
        ("0.75", "\\frac34", True),
        (".5", "\\frac{1}{2}", True),
        ("10\\text{ cm}", "10", True),  # trailing unit
        ("90^\\circ", "90", True),
        ("x = 5", "5", True),  # short assignment
        ("\\sqrt3", "\\sqrt{3}", True),
        ("1,000", "1000", True),
        ("5 dollars", "5", True),
        ("\\left( 1, 2 \\right)", "(1,2)", True),
        ("-\\frac{1}{2}", "-0.5", True),
        ("2", "3", False),
        ("\\frac{1}{3}", "0.33", False),  # exact rationals: 0.33 is not 1/3
        ("(1,2)", "(2,1)", False),
        ("", "0", False),
        (None, "1", False),  # no answer at all
    ],
)
def test_math_answers_equal(prediction, reference, equal):
    assert math_answers_equal(prediction, reference) is equal


def test_normalize_is_idempotent_on_examples():
    for raw in ["\\frac12", "10\\text{ cm}", " .5 ", "\\left(1,2\\right)", "3/4"]:
        once = normalize_math_answer(raw)
        assert normalize_math_answer(once) == once
