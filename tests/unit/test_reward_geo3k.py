"""The geo3k reward: verl's rule, 0.9 x accuracy of the last boxed answer + 0.1 x the think/boxed format."""

from __future__ import annotations

import pytest
from verity.rewards.builtin import geo3k
from verity.rewards.registry import resolve_spec


@pytest.mark.parametrize(
    ("response", "truth", "score", "acc"),
    [
        ("<think>two sides</think> so \\boxed{12}", "12", 1.0, 1.0),
        ("<think>x</think>\\boxed{\\frac{1}{2}}", "\\frac12", 1.0, 1.0),
        ("the answer is \\boxed{12}", "12", 0.9, 1.0),  # right, without the reasoning tags
        ("<think>x</think> \\boxed{13}", "12", 0.1, 0.0),  # the format alone
        ("12", "12", 0.0, 0.0),  # no boxed answer at all
    ],
)
def test_geo3k_scores_accuracy_and_format(response: str, truth: str, score: float, acc: float) -> None:
    result = geo3k("hiyouga/geometry3k", response, truth)
    assert result["score"] == pytest.approx(score) and result["acc"] == acc


def test_verls_geo3k_rows_dispatch_to_it() -> None:
    assert resolve_spec("hiyouga/geometry3k") == "geo3k"
