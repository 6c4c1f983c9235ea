"""Validation metrics: pass@k (unbiased), maj@k, mean@1 per data source (hand-computed values)."""

from __future__ import annotations

import math

import pytest
from verity.rewards.metrics import maj_at_k, majority_correct, pass_at_k, validation_metrics


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 4, 2, 1.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 4, 1 - math.comb(7, 4) / math.comb(10, 4)),
        (3, 2, 2, 1.0),  # n - c < k
    ],
)
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_majority_vote():
    assert majority_correct(["5", "6", "5"], [True, False, True]) == 1.0
    assert majority_correct(["6", "6", "5"], [False, False, True]) == 0.0
    assert majority_correct(["6", "5"], [False, True]) == 0.0  # tie: first seen answer wins
    assert majority_correct([None, None], [False, False]) == 0.0  # no votes
    assert majority_correct([None, None, "5"], [False, False, True]) == 1.0  # None does not vote


def test_maj_at_k_bootstrap_is_seeded_and_exact_for_k_equal_n():
    preds, correct = ["1", "2", "2", "1", "1"], [True, False, False, True, True]
    assert maj_at_k(preds, correct, 5) == 1.0
    assert maj_at_k(preds, correct, 1, num_bootstrap=2000) == pytest.approx(0.6, abs=0.05)
    assert maj_at_k(preds, correct, 3, seed=1) == maj_at_k(preds, correct, 3, seed=1)


def test_validation_metrics_per_source():
    # prompt a (gsm8k): scores 1,0,0,1 ; prompt b (gsm8k): 0,0,0,0 ; prompt c (math): 1,1,1,0
    sources = ["gsm8k"] * 8 + ["math"] * 4
    ids = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    scores = [1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0]
    preds = ["4", "5", "5", "4", "1", "2", "3", "1", "x", "x", "x", "y"]
    m = validation_metrics(sources, ids, scores, preds)
    assert m["val/gsm8k/mean@1"] == pytest.approx(2 / 8)
    assert m["val/gsm8k/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["val/gsm8k/pass@2"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2)) / 2)
    assert m["val/gsm8k/pass@4"] == pytest.approx(0.5)
    assert m["val/gsm8k/maj@4"] == pytest.approx(0.5)  # a: "4" vs "5" tie, "4" seen first -> right; b: wrong
    assert m["val/math/mean@1"] == pytest.approx(0.75)
    assert m["val/math/pass@4"] == 1.0 and m["val/math/maj@4"] == 1.0
    assert m["val/all/mean@1"] == pytest.approx(5 / 12)
    assert set(k for k in m if k.startswith("val/math/pass@")) == {
        "val/math/pass@1",
        "val/math/pass@2",
        "val/math/pass@4",
    }


def test_validation_metrics_threshold_and_lengths():
    m = validation_metrics(["s", "s"], [0, 0], [0.6, 0.2], ks=[1], correct_threshold=0.5)
    assert m["val/s/pass@1"] == 0.5 and "val/s/maj@1" not in m
    with pytest.raises(ValueError, match="equal lengths"):
        validation_metrics(["s"], [0, 1], [1.0, 0.0])
