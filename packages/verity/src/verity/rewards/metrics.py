"""Validation metrics per data source: mean@1, pass@k and maj@k.

Validation generates ``n`` responses per prompt. With ``c`` of them correct
(score >= ``correct_threshold``):

- ``mean@1`` — the mean score over all responses: the expected score of one sample.
- ``pass@k`` — the probability that at least one of ``k`` responses drawn without
  replacement from the ``n`` is correct, with the unbiased estimator of Chen et al.
  (2021), averaged over prompts::

      pass@k = 1 - C(n - c, k) / C(n, k)      (= 1 when n - c < k)

  computed as ``1 - prod_{i = n-c+1}^{n} (1 - k / i)`` to stay finite for large ``n``.
- ``maj@k`` — majority voting: among ``k`` responses, the most frequent extracted
  answer (``pred``; ties go to the answer seen first) is the prompt's answer, and the
  prompt scores 1 when that answer's responses are correct (their mean correctness
  >= 0.5). For ``k == n`` this is exact; for ``k < n`` it is averaged over
  ``num_bootstrap`` seeded random subsets of size ``k``. Responses without an answer
  (``pred`` None) do not vote; a prompt with no votes scores 0.

Metric names: ``<prefix>/<data_source>/mean@1``, ``.../pass@<k>``, ``.../maj@<k>``, plus
the same over all sources as ``<prefix>/all/...``.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with ``n`` samples of which ``c`` are correct (needs ``k <= n``)."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_correct(preds: Sequence[Hashable | None], correct: Sequence[bool]) -> float:
    """1.0 when the most frequent non-None answer (first seen wins ties) is mostly correct, else 0.0."""
    counts: dict[Hashable, int] = {}
    right: dict[Hashable, int] = {}
    for pred, ok in zip(preds, correct, strict=True):
        if pred is None:
            continue
        counts[pred] = counts.get(pred, 0) + 1
        right[pred] = right.get(pred, 0) + int(ok)
    if not counts:
        return 0.0
    winner = max(counts, key=lambda answer: counts[answer])  # dicts keep first-seen order for ties
    return 1.0 if right[winner] * 2 >= counts[winner] else 0.0


def maj_at_k(
    preds: Sequence[Hashable | None],
    correct: Sequence[bool],
    k: int,
    num_bootstrap: int = 64,
    seed: int = 0,
) -> float:
    """maj@k for one prompt (exact for ``k == len(preds)``, else a seeded bootstrap mean)."""
    n = len(preds)
    if k < 1 or k > n:
        raise ValueError(f"maj_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if k == n:
        return majority_correct(preds, correct)
    rng = random.Random(seed)
    total = 0.0
    for _ in range(num_bootstrap):
        chosen = sorted(rng.sample(range(n), k))
        total += majority_correct([preds[i] for i in chosen], [correct[i] for i in chosen])
    return total / num_bootstrap


def _ks_for(n: int, ks: Sequence[int] | None) -> list[int]:
    if ks is not None:
        return [k for k in ks if 1 <= k <= n]
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    out.append(n)
    return sorted(set(out))


def validation_metrics(
    data_sources: Sequence[str],
    prompt_ids: Sequence[Hashable],
    scores: Sequence[float],
    preds: Sequence[Hashable | None] | None = None,
    ks: Sequence[int] | None = None,
    correct_threshold: float = 1.0,
    prefix: str = "val",
    seed: int = 0,
) -> dict[str, float]:
    """mean@1, pass@k and maj@k per data source (and ``all``), from one flat list of scored responses.

    Args:
        data_sources, prompt_ids, scores: one entry per response; responses with the same
            prompt id are the samples of one prompt.
        preds: extracted answers (e.g. the reward's ``pred`` extra) for maj@k; None skips maj@k.
        ks: the k values; default 1, 2, 4, ... up to the smallest samples-per-prompt count.
        correct_threshold: a response with ``score >= correct_threshold`` is correct.
    """
    n_rows = len(scores)
    if not len(data_sources) == len(prompt_ids) == n_rows or (preds is not None and len(preds) != n_rows):
        raise ValueError(
            "validation_metrics: data_sources, prompt_ids, scores (and preds) must have equal lengths"
        )
    prompts: dict[Hashable, list[int]] = {}
    for row, pid in enumerate(prompt_ids):
        prompts.setdefault(pid, []).append(row)
    groups: dict[str, list[list[int]]] = {"all": []}
    for rows in prompts.values():
        groups.setdefault(data_sources[rows[0]], []).append(rows)
        groups["all"].append(rows)
    metrics: dict[str, float] = {}
    for source, prompt_rows in groups.items():
        if not prompt_rows:
            continue
        flat = [scores[r] for rows in prompt_rows for r in rows]
        metrics[f"{prefix}/{source}/mean@1"] = sum(flat) / len(flat)
        n_min = min(len(rows) for rows in prompt_rows)
        for k in _ks_for(n_min, ks):
            pass_values = []
            maj_values = []
            for rows in prompt_rows:
                correct = [scores[r] >= correct_threshold for r in rows]
                pass_values.append(pass_at_k(len(rows), sum(correct), k))
                if preds is not None:
                    maj_values.append(maj_at_k([preds[r] for r in rows], correct, k, seed=seed))
            metrics[f"{prefix}/{source}/pass@{k}"] = sum(pass_values) / len(pass_values)
            if preds is not None:
                metrics[f"{prefix}/{source}/maj@{k}"] = sum(maj_values) / len(maj_values)
    return metrics
