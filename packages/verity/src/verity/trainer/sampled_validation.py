"""Sampled held-out evaluation: ``k`` responses per prompt, scored as avg@k and pass@k.

With ``rollout.val_n = k > 1`` every evaluation of a run (before training, every
``trainer.val_every`` steps, after the last step) samples ``k`` responses to each
held-out prompt at ``rollout.val_temperature`` (and ``rollout.val_top_p``, else
``rollout.top_p``), beside the greedy pass that gives ``val/acc``. With ``c_p`` of the
``k`` responses to prompt ``p`` correct (the verifier's ``acc``, else ``score > 0``)
over ``N`` prompts:

- ``val/avg_at_k = (1/N) sum_p c_p / k`` — the mean correctness of one sample (the
  DAPO paper's avg@32 on AIME is this with ``k = 32``; ``mean@1`` in
  :func:`verity.rewards.metrics.validation_metrics`);
- ``val/pass_at_k = (1/N) sum_p [c_p > 0]`` — the share of prompts with at least one
  correct response among the ``k`` (the unbiased estimator of Chen et al. at ``n = k``);
- ``val/k`` — the ``k`` used, so the names stay the same whatever ``k`` is
  (MLflow does not allow ``@`` in metric names);
- ``val/<data_source>/avg_at_k`` and ``.../pass_at_k`` per data source;
- ``val/sampled_response_length`` (tokens, mean over the samples) and
  ``val/sampled_clip_ratio`` (share of samples that used the whole response budget).

The samples are drawn with a seed derived from ``trainer.seed`` and the step, so the
same run evaluates the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from verity.config.schema import VerityConfig
from verity.rewards.metrics import validation_metrics

SAMPLED_SEED_OFFSET = 777_767
"""Added to the evaluation seed so the sampled pass never reuses the greedy pass's stream."""


def sampled_validation_sampling(cfg: VerityConfig) -> dict[str, Any]:
    """Sampling of the ``k`` held-out samples (rows are already repeated, so ``n = 1``)."""
    r = cfg.rollout
    return {
        "do_sample": True,
        "temperature": r.val_temperature,
        "top_p": r.val_top_p if r.val_top_p is not None else r.top_p,
        "top_k": r.top_k if r.top_k > 0 else -1,
        "max_new_tokens": cfg.data.max_response_length,
        "n": 1,
    }


def correctness(scores: list[float], acc: list[Any] | None) -> list[float]:
    """Per response 1.0/0.0: the verifier's ``acc`` where it reports one, else ``score > 0``."""
    acc = acc or [None] * len(scores)
    return [float(a) if a is not None else float(s > 0) for a, s in zip(acc, scores, strict=True)]


def sampled_validation(
    cfg: VerityConfig,
    actor: Any,
    rewards: Any,
    val_batches: Callable[[], Iterable[Any]],
    step: int,
) -> dict[str, float]:
    """avg@k, pass@k (overall and per data source) of ``k = rollout.val_n`` samples per held-out prompt.

    Args:
        cfg: the run config (``rollout.val_n``, ``val_temperature``, ``val_top_p``).
        actor: the actor group (``generate`` on a repeated prompt batch).
        rewards: the reward manager (``score(batch) -> (scores [B], extra, metrics)``).
        val_batches: returns an iterable of held-out prompt batches (each prompt's ``uid`` unique).
        step: the RL step evaluated (0 = before training); seeds the sampling.
    Returns:
        the metrics named in the module docstring.
    """
    k = cfg.rollout.val_n
    if k < 2:
        raise ValueError(f"rollout.val_n: sampled validation needs k >= 2 samples per prompt, got {k}")
    sources: list[str] = []
    uids: list[str] = []
    correct: list[float] = []
    lengths = 0.0
    clipped = 0.0
    budget = cfg.data.max_response_length
    for prompts in val_batches():
        rows = prompts.repeat_interleave(k)
        rows.meta["sampling"] = sampled_validation_sampling(cfg)
        rows.meta["seed"] = cfg.trainer.seed * 1_000_003 + SAMPLED_SEED_OFFSET + step
        out = actor.generate(rows)
        scores, extra, _ = rewards.score(out)
        correct += correctness(scores.tolist(), extra.get("acc"))
        sources += list(out["data_source"])
        uids += list(out["uid"])
        response_lengths = out["response_mask"].float().sum(-1)
        lengths += float(response_lengths.sum())
        clipped += float((response_lengths >= budget).float().sum())
    if not correct:
        raise ValueError("validation set is empty: give data.val_files or use the embedded task")
    raw = validation_metrics(sources, uids, correct, ks=[k], correct_threshold=1.0, prefix="val")
    metrics: dict[str, float] = {"val/k": float(k)}
    for name, value in raw.items():
        source, quantity = name[len("val/") :].rsplit("/", 1)  # a source may hold "/" itself
        renamed = {"mean@1": "avg_at_k", f"pass@{k}": "pass_at_k"}.get(quantity)
        if renamed is None:
            continue
        metrics["val/" + renamed if source == "all" else f"val/{source}/{renamed}"] = value
    metrics["val/sampled_response_length"] = lengths / len(correct)
    metrics["val/sampled_clip_ratio"] = clipped / len(correct)
    return metrics
