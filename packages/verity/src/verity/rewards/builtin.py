"""The built-in verifiable reward functions.

Each has the verl signature ``fn(data_source, solution_str, ground_truth,
extra_info=None, **kwargs)`` and returns a dict with ``score`` (float), ``acc``
(1.0 when the answer is correct, else 0.0) and ``pred`` (the extracted answer,
or None), so that validation can compute maj@k from ``pred``.

========================  ==========================================================  ==============
name                      answer read from the response                               score
========================  ==========================================================  ==============
``gsm8k_strict``          last ``#### N``                                             1 / 0
``gsm8k_flexible``        last number anywhere                                        1 / 0
``math_boxed``            last ``\\boxed{}``, compared by :mod:`.math_normalize`       1 / 0
``math_verify``           math-verify parse of the response vs ``\\boxed{gt}``         1 / 0
``dapo``                  last ``Answer:`` line, normalised                           1 / -1 (DAPO)
``aime``                  integer in the last ``\\boxed{}`` or ``Answer:``             1 / 0
``geo3k``                 last ``\\boxed{}`` as ``math_boxed``, plus a format bonus       0.9 acc + 0.1 format
========================  ==========================================================  ==============

math-verify's ``parse``/``verify`` enforce their own timeouts with
``signal.alarm``, which only works in a process's main thread; here they are
called with their timeouts disabled and the caller bounds the time instead
(:class:`verity.rewards.manager.RewardManager` runs every verification in a
worker process that is killed at the per-sample timeout).
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from verity.rewards.extractors import (
    extract_boxed,
    extract_dapo_answer,
    extract_gsm8k_strict,
    extract_integer_answer,
    extract_last_number,
    parse_integer,
    strip_math_delimiters,
)
from verity.rewards.math_normalize import math_answers_equal, normalize_math_answer


def _result(correct: bool, pred: str | None, wrong_score: float = 0.0) -> dict[str, Any]:
    return {"score": 1.0 if correct else wrong_score, "acc": 1.0 if correct else 0.0, "pred": pred}


def numbers_equal(prediction: str | None, reference: str | int | float) -> bool:
    """Exact decimal equality of two numeric strings (``"72.0" == "72"``); False if either is not a number."""
    if prediction is None:
        return False
    try:
        return Decimal(prediction) == Decimal(str(reference).replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return False


def gsm8k_strict(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> dict[str, Any]:
    """GSM8K with the reference format: the number after the last ``####`` must equal ``ground_truth``."""
    pred = extract_gsm8k_strict(solution_str)
    return _result(numbers_equal(pred, ground_truth), pred)


def gsm8k_flexible(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> dict[str, Any]:
    """GSM8K graded on the last number anywhere in the response."""
    pred = extract_last_number(solution_str)
    return _result(numbers_equal(pred, ground_truth), pred)


def math_boxed(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> dict[str, Any]:
    """MATH: the last ``\\boxed{}`` equals the reference after normalisation (or as the same rational)."""
    pred = extract_boxed(solution_str)
    reference = str(ground_truth)
    boxed_reference = extract_boxed(reference)
    if boxed_reference is not None:
        reference = boxed_reference
    return _result(math_answers_equal(pred, reference), pred)


def _quiet_math_verify() -> None:
    # math-verify warns once per process that its own timeouts are off; we bound time outside it.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def math_verify(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> dict[str, Any]:
    """Symbolic equality with math-verify: the response (LaTeX or plain expression) vs ``\\boxed{ground_truth}``.

    Timeouts inside math-verify are disabled (``parsing_timeout=None``,
    ``timeout_seconds=None``): bound the time from outside (the reward pool does).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    _quiet_math_verify()
    reference = str(ground_truth)
    if extract_boxed(reference) is None:
        reference = "\\boxed{" + strip_math_delimiters(reference) + "}"
    gold = parse(reference, extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    if not gold:
        raise ValueError(f"ground_truth: math-verify could not parse {ground_truth!r}")
    answer = parse(
        solution_str,
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=None,
    )
    if not answer:
        return _result(False, None)
    correct = bool(verify(gold, answer, timeout_seconds=None))
    pred = str(answer[-1])  # parse returns [sympy object, matched string]
    return _result(correct, pred)


def dapo(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> dict[str, Any]:
    """DAPO math: the last ``Answer:`` line equals the reference after normalisation; 1.0 if so, else -1.0."""
    raw = extract_dapo_answer(solution_str)
    pred = None if raw is None else normalize_math_answer(strip_math_delimiters(raw))
    reference = str(ground_truth)
    correct = pred is not None and math_answers_equal(pred, reference)
    return _result(correct, pred, wrong_score=-1.0)


def aime(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> dict[str, Any]:
    """AIME: an integer answer (``\\boxed{N}`` or ``Answer: N``) equal to the integer ``ground_truth``."""
    expected = parse_integer(ground_truth)
    if expected is None:
        raise ValueError(f"ground_truth: AIME expects an integer, got {ground_truth!r}")
    pred = extract_integer_answer(solution_str)
    return _result(pred is not None and int(pred) == expected, pred)


GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
"""The response format verl's geometry3k prompt asks for: reasoning in ``<think>...</think>``, then
a ``\\boxed{}`` answer (the whole response must match)."""


def geo3k(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> dict[str, Any]:
    """Geometry3K (verl's ``hiyouga/geometry3k`` rows): ``score = 0.9 * acc + 0.1 * format``.

    ``acc``: the last ``\\boxed{}`` equals the reference (``math_boxed``'s comparison);
    ``format``: the whole response matches :data:`GEO3K_FORMAT`. The weights are the rule of
    verl's geo3k reward; answers are compared by :mod:`.math_normalize`, not by verl's grader.
    """
    result = math_boxed(data_source, solution_str, ground_truth)
    formatted = GEO3K_FORMAT.fullmatch(solution_str.strip()) is not None
    result["score"] = 0.9 * result["acc"] + 0.1 * float(formatted)
    result["format"] = float(formatted)
    return result


BUILTIN_REWARD_FUNCTIONS = {
    "geo3k": geo3k,
    "gsm8k_strict": gsm8k_strict,
    "gsm8k_flexible": gsm8k_flexible,
    "math_boxed": math_boxed,
    "math_verify": math_verify,
    "dapo": dapo,
    "aime": aime,
}
"""Name -> reward function, for the functions in this module (``code_sandbox`` lives in :mod:`.code`)."""
