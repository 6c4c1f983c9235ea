"""The one held-out evaluation path of ``verity train`` and ``verity eval``: accuracy, avg@k, pass@k, maj@k.

A pass generates responses to held-out prompt batches (through a run's actor group or a
model in this process: the caller's ``generate``), scores them with the reward manager
and keeps, per response, its prompt (``uid``), data source, correctness and extracted
answer. A response is correct when its verifier reports ``acc`` true, or, for a reward
function that reports no ``acc``, when its score is > 0.

With ``N`` prompts, ``k`` responses each, ``c_p`` of them correct for prompt ``p``:

- ``val/acc`` — one response per prompt (greedy, or one sample at the evaluation
  temperature): ``(1/N) sum_p c_p``; also ``val/reward`` (mean score),
  ``val/response_length`` (tokens), ``val/samples`` and ``val/<data_source>/acc``;
- ``val/avg_at_k = (1/N) sum_p c_p / k`` — the expected correctness of one sample (the
  DAPO paper's avg@32 on AIME is this with ``k = 32``);
- ``val/pass_at_k = (1/N) sum_p [1 - C(k - c_p, k) / C(k, k)]`` — the unbiased estimator
  of Chen et al. (2021), ``pass@j = 1 - C(n - c, j) / C(n, j)`` (1 when ``n - c < j``),
  at ``n = j = k``: the share of prompts with a correct response among the ``k``.
  :func:`pass_at_k` computes it as ``1 - prod_{i=n-c+1}^{n} (1 - j / i)``, finite for any ``n``;
- ``val/maj_at_k`` — majority vote (when the verifiers report an extracted answer
  ``pred``): the most frequent answer among the ``k`` (first seen wins a tie) is the
  prompt's, and the prompt counts when that answer's responses are mostly correct;
- ``val/k``; ``val/<data_source>/avg_at_k``, ``.../pass_at_k``, ``.../maj_at_k``;
  ``val/sampled_response_length`` (tokens) and ``val/sampled_clip_ratio`` (share of the
  samples that used the whole response budget).

MLflow does not allow ``@`` in metric names, hence ``avg_at_k`` with ``val/k`` beside it.
A run (:meth:`verity.trainer.loop.RLTrainer.validate`) makes the one-response pass at every
evaluation and, with ``rollout.val_n = k > 1``, a ``k``-sample pass beside it;
``verity eval`` (:func:`verity.evaluation.held_out.evaluate_files`) makes the one-response pass
for ``-k 1`` and the ``k``-sample pass otherwise. Both write the names above.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from verity.rollout.agent.metrics import merge_validation_counts, validation_agent_metrics

SAMPLED_SEED_OFFSET = 777_767
"""Added to a run's evaluation seed so the sampled pass never reuses the one-response pass's stream."""
ONE_SEED_OFFSET = 999_983
"""Added to ``trainer.seed * 1_000_003 + step`` for the one-response pass of a run."""

EMPTY_MESSAGE = "validation set is empty: give data.val_files or use the embedded task"


# ------------------------------------------------------------------------------ estimators
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct: ``1 - C(n-c, k) / C(n, k)``.

    Needs ``0 <= c <= n`` and ``1 <= k <= n``; computed as a product of ``c`` factors in [0, 1).
    """
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
    """maj@k of one prompt: exact for ``k == len(preds)``, else the mean over ``num_bootstrap`` seeded subsets."""
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


def correctness(scores: Sequence[float], acc: Sequence[Any] | None) -> list[float]:
    """Per response 1.0/0.0: the verifier's ``acc`` where it reports one, else ``score > 0``."""
    acc = acc or [None] * len(scores)
    return [float(a) if a is not None else float(s > 0) for a, s in zip(acc, scores, strict=True)]


# ------------------------------------------------------------------------------- a pass
@dataclass
class ScoredSamples:
    """Every scored response of one pass, in generation order (each list: one entry a response)."""

    k: int
    budget: int | None = None  # response budget in tokens (for the clip ratio), None: not known
    data_sources: list[str] = field(default_factory=list)
    prompt_ids: list[Hashable] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    preds: list[Hashable | None] = field(default_factory=list)
    score_sum: float = 0.0
    length_sum: float = 0.0  # response tokens
    clipped: float = 0.0  # responses that used the whole budget
    agent_totals: dict[str, float] = field(default_factory=dict)

    def groups(self) -> dict[str, list[list[int]]]:
        """Row indices grouped by prompt, per data source and under ``all`` (first-seen order)."""
        prompts: dict[Hashable, list[int]] = {}
        for row, pid in enumerate(self.prompt_ids):
            prompts.setdefault(pid, []).append(row)
        out: dict[str, list[list[int]]] = {"all": []}
        for rows in prompts.values():
            out.setdefault(self.data_sources[rows[0]], []).append(rows)
            out["all"].append(rows)
        return out


def score_pass(
    generate: Callable[[Any], Any],
    rewards: Any,
    batches: Iterable[Any],
    k: int = 1,
    budget: int | None = None,
) -> ScoredSamples:
    """Generate ``k`` responses to every prompt of ``batches`` and score them.

    Args:
        generate: ``Batch -> Batch`` of responses (``response_mask [B, R]``, ``data_source``,
            ``uid`` when prompts carry one); it sets the sampling and seed.
        rewards: ``score(batch) -> (scores [B], extra, metrics)`` (``extra``: ``acc``, ``pred``).
        batches: held-out prompt batches; each prompt's rows are repeated ``k`` times in place.
        k: responses per prompt; ``budget``: the response budget in tokens.
    Raises:
        ValueError: when the batches hold no prompt.
    """
    if k < 1:
        raise ValueError(f"k: expected >= 1 responses per prompt, got {k}")
    samples = ScoredSamples(k=k, budget=budget)
    for prompts in batches:
        out = generate(prompts.repeat_interleave(k) if k > 1 else prompts)
        scores, extra, _ = rewards.score(out)
        score_list = scores.tolist()
        samples.correct += correctness(score_list, extra.get("acc"))
        samples.preds += list(extra.get("pred") or [None] * len(score_list))
        samples.score_sum += float(scores.sum())
        samples.data_sources += list(out["data_source"])
        first = len(samples.prompt_ids)
        ids = out["uid"] if "uid" in out else range(first, first + len(score_list))
        samples.prompt_ids += list(ids)
        response_lengths = out["response_mask"].float().sum(-1)
        samples.length_sum += float(response_lengths.sum())
        if budget is not None:
            samples.clipped += float((response_lengths >= budget).float().sum())
        merge_validation_counts(samples.agent_totals, out)
    if not samples.correct:
        raise ValueError(EMPTY_MESSAGE)
    return samples


# ----------------------------------------------------------------------------- metrics
def one_response_metrics(samples: ScoredSamples) -> dict[str, float]:
    """``val/acc``, ``val/reward``, ``val/response_length``, ``val/samples``, ``val/<source>/acc``
    and the agent rates of a one-response pass."""
    if samples.k != 1:
        raise ValueError(f"one_response_metrics: a one-response pass has k = 1, got k = {samples.k}")
    total = float(len(samples.correct))
    metrics = {
        "val/acc": sum(samples.correct) / total,
        "val/reward": samples.score_sum / total,
        "val/response_length": samples.length_sum / total,
        "val/samples": total,
    }
    per_source: dict[str, list[float]] = {}
    for source, ok in zip(samples.data_sources, samples.correct, strict=True):
        per_source.setdefault(source, []).append(ok)
    for source, values in per_source.items():
        metrics[f"val/{source}/acc"] = sum(values) / len(values)
    metrics.update(validation_agent_metrics(samples.agent_totals))
    return metrics


def sampled_metrics(samples: ScoredSamples, seed: int = 0) -> dict[str, float]:
    """``val/k``, avg@k, pass@k, maj@k (overall and per source) and the samples' length and clip ratio."""
    k = samples.k
    if k < 2:
        raise ValueError(f"sampled_metrics: needs k >= 2 samples per prompt, got k = {k}")
    with_preds = any(p is not None for p in samples.preds)
    metrics: dict[str, float] = {"val/k": float(k)}
    for source, prompts in samples.groups().items():
        if not prompts:
            continue
        name = "val/" if source == "all" else f"val/{source}/"
        flat = [samples.correct[r] for rows in prompts for r in rows]
        metrics[name + "avg_at_k"] = sum(flat) / len(flat)
        passes, votes = [], []
        for rows in prompts:
            ok = [samples.correct[r] >= 1.0 for r in rows]
            passes.append(pass_at_k(len(rows), sum(ok), min(k, len(rows))))
            if with_preds:
                votes.append(maj_at_k([samples.preds[r] for r in rows], ok, min(k, len(rows)), seed=seed))
        metrics[name + "pass_at_k"] = sum(passes) / len(passes)
        if with_preds:
            metrics[name + "maj_at_k"] = sum(votes) / len(votes)
    metrics["val/sampled_response_length"] = samples.length_sum / len(samples.correct)
    if samples.budget is not None:
        metrics["val/sampled_clip_ratio"] = samples.clipped / len(samples.correct)
    return metrics


# ------------------------------------------------------------------------------ a run's
def validation_sampling(cfg: Any) -> dict[str, Any]:
    """Sampling of a run's one-response pass (``val/acc``).

    Greedy at ``rollout.val_temperature == 0``, else one sample at it with
    ``rollout.val_top_p`` (``rollout.top_p`` when null); greedy whenever
    ``rollout.val_n > 1`` (the ``k`` samples then go to avg@k, pass@k and maj@k).
    """
    temperature = cfg.rollout.val_temperature if cfg.rollout.val_n == 1 else 0.0
    sampled = temperature > 0
    top_p = cfg.rollout.top_p if cfg.rollout.val_top_p is None else cfg.rollout.val_top_p
    return {
        "do_sample": sampled,
        "temperature": temperature if sampled else 0.0,
        "top_p": top_p if sampled else 1.0,
        "top_k": (cfg.rollout.top_k if cfg.rollout.top_k > 0 else -1) if sampled else -1,
        "max_new_tokens": cfg.data.max_response_length,
        "n": 1,
    }


def sampled_validation_sampling(cfg: Any) -> dict[str, Any]:
    """Sampling of a run's ``k`` held-out samples (rows are already repeated, so ``n = 1``)."""
    r = cfg.rollout
    return {
        "do_sample": True,
        "temperature": r.val_temperature,
        "top_p": r.val_top_p if r.val_top_p is not None else r.top_p,
        "top_k": r.top_k if r.top_k > 0 else -1,
        "max_new_tokens": cfg.data.max_response_length,
        "n": 1,
    }


def run_validation(
    cfg: Any, actor: Any, rewards: Any, val_batches: Callable[[], Iterable[Any]], step: int
) -> dict[str, float]:
    """A run's held-out metrics at ``step``: the one-response pass and, with ``rollout.val_n > 1``, the sampled one.

    Args:
        cfg: the run config (``rollout.val_*``, ``data.max_response_length``, ``trainer.seed``).
        actor: the actor group (``generate(batch)`` reading ``meta["sampling"]``, ``meta["seed"]``).
        rewards: the reward manager; ``val_batches``: returns an iterable of held-out prompt batches.
        step: the RL step evaluated (0 = before training); it seeds the sampling.
    """
    base = cfg.trainer.seed * 1_000_003 + step

    def generator(sampling: dict[str, Any], seed: int) -> Callable[[Any], Any]:
        def generate(rows: Any) -> Any:
            rows.meta["sampling"] = sampling
            rows.meta["seed"] = seed
            return actor.generate(rows)

        return generate

    one = score_pass(generator(validation_sampling(cfg), base + ONE_SEED_OFFSET), rewards, val_batches())
    metrics = one_response_metrics(one)
    k = cfg.rollout.val_n
    if k > 1:
        sampled = score_pass(
            generator(sampled_validation_sampling(cfg), base + SAMPLED_SEED_OFFSET),
            rewards,
            val_batches(),
            k=k,
            budget=cfg.data.max_response_length,
        )
        metrics.update(sampled_metrics(sampled))
    return metrics
