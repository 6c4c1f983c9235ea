"""Held-out metrics: pass@k against brute-force enumeration, maj@k, avg@k and the one naming."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from verity.batch import Batch
from verity.evaluation.validation import (
    ScoredSamples,
    correctness,
    maj_at_k,
    majority_correct,
    one_response_metrics,
    pass_at_k,
    sampled_metrics,
    score_pass,
)


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of all k-subsets of n samples (c of them correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_equals_enumeration_over_every_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_stays_finite_where_the_binomials_overflow_a_float():
    n, c, k = 2000, 3, 1000  # C(2000, 1000) ~ 1e600
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one rounding
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="1 <= k <= n"):
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


def test_correctness_takes_acc_else_a_positive_score():
    assert correctness([1.0, -1.0, 0.5, 0.0], [None, None, None, None]) == [1.0, 0.0, 1.0, 0.0]
    assert correctness([1.0, -1.0], [False, True]) == [0.0, 1.0]
    assert correctness([0.2], None) == [1.0]


def test_sampled_metrics_per_source_and_overall():
    # prompt a (gsm8k): 1,0,0,1 ; prompt b (gsm8k): 0,0,0,0 ; prompt c (math): 1,1,1,0
    samples = ScoredSamples(
        k=4,
        budget=8,
        data_sources=["gsm8k"] * 8 + ["math"] * 4,
        prompt_ids=["a"] * 4 + ["b"] * 4 + ["c"] * 4,
        correct=[1.0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0],
        preds=["4", "5", "5", "4", "1", "2", "3", "1", "x", "x", "x", "y"],
        length_sum=48.0,
        clipped=3.0,
    )
    m = sampled_metrics(samples)
    assert m["val/k"] == 4.0
    assert m["val/gsm8k/avg_at_k"] == pytest.approx(2 / 8)
    assert m["val/gsm8k/pass_at_k"] == pytest.approx(0.5)
    assert m["val/gsm8k/maj_at_k"] == pytest.approx(0.5)  # a: "4" vs "5" tie, "4" seen first -> right
    assert m["val/math/avg_at_k"] == pytest.approx(0.75) and m["val/math/pass_at_k"] == 1.0
    assert m["val/avg_at_k"] == pytest.approx(5 / 12) and m["val/pass_at_k"] == pytest.approx(2 / 3)
    assert m["val/maj_at_k"] == pytest.approx(2 / 3)
    assert m["val/sampled_response_length"] == 4.0 and m["val/sampled_clip_ratio"] == 0.25
    assert not any("@" in name for name in m)  # MLflow names
    samples.preds = [None] * 12
    assert "val/maj_at_k" not in sampled_metrics(samples)
    with pytest.raises(ValueError, match="k >= 2"):
        sampled_metrics(ScoredSamples(k=1, correct=[1.0], data_sources=["s"], prompt_ids=[0]))


class _Rewards:
    def score(self, out):
        scores = torch.tensor(out["score"], dtype=torch.float32)
        return scores, {"pred": [str(s) for s in out["score"]]}, {}


def test_score_pass_repeats_each_prompt_k_times_and_groups_by_uid():
    prompts = Batch.from_dict(
        {"input_ids": torch.ones(2, 3, dtype=torch.long)}, {"uid": ["p", "q"], "data_source": ["s", "t"]}
    )
    seen = []

    def generate(rows):
        seen.append(list(rows["uid"]))
        out = rows.select(*rows.keys())
        out["response_mask"] = torch.ones(len(rows), 2, dtype=torch.long)
        out["score"] = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0][: len(rows)]
        return out

    samples = score_pass(generate, _Rewards(), [prompts], k=3, budget=2)
    assert seen == [["p", "p", "p", "q", "q", "q"]]
    m = sampled_metrics(samples)
    assert m["val/s/avg_at_k"] == pytest.approx(1 / 3) and m["val/s/pass_at_k"] == 1.0
    assert m["val/t/pass_at_k"] == 0.0 and m["val/sampled_clip_ratio"] == 1.0
    one = one_response_metrics(score_pass(generate, _Rewards(), [prompts]))
    assert one["val/acc"] == 0.5 and one["val/s/acc"] == 1.0 and one["val/samples"] == 2.0
    with pytest.raises(ValueError, match="validation set is empty"):
        score_pass(generate, _Rewards(), [])
