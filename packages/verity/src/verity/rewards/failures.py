"""What the reward manager says, and does, when reward functions fail or time out.

Per call of :meth:`RewardManager.score` (one step's samples, or one validation batch):

- failures are reported once, as a summary: how many errors and timeouts, and the first
  failure with its data source, reward function, response and ground truth (the
  per-sample lines go to the DEBUG level of logger ``verity.rewards``);
- when errors + timeouts exceed ``max_failure_rate`` of the samples, scoring raises
  :class:`RewardFailureError` with the first failure's traceback: a run whose reward
  function fails on most samples stops instead of training on failure scores.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("verity.rewards")


class RewardFailureError(RuntimeError):
    """Too many samples of one scoring call failed or timed out (see the module docstring)."""


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else ""


def _describe(index: int, row: dict[str, Any], spec: str, log_chars: int) -> str:
    return (
        f"sample {index} (data_source={row['data_source']!r}, reward={spec!r}), "
        f"response={row['solution_str'][:log_chars]!r}, ground_truth={row['ground_truth']!r}"
    )


def describe_first_failure(
    rows: Sequence[dict[str, Any]], specs: Sequence[str], outcomes: Sequence[Any], log_chars: int = 400
) -> str | None:
    """The first failed sample (data source, reward function, response, ground truth) and its
    traceback, as :func:`report_failures` would stop with it; None when every sample scored."""
    for i, outcome in enumerate(outcomes):
        if outcome.status != "ok":
            return (
                f"{_describe(i, rows[i], specs[i], log_chars)}:\n{(outcome.error or outcome.status).rstrip()}"
            )
    return None


def report_failures(
    rows: Sequence[dict[str, Any]],
    specs: Sequence[str],
    outcomes: Sequence[Any],
    *,
    failure_score: float,
    max_failure_rate: float,
    log_chars: int = 400,
) -> None:
    """Log one summary of the failed samples; raise :class:`RewardFailureError` above the rate.

    Args:
        rows: the scored samples (``data_source``, ``solution_str``, ``ground_truth``).
        specs: the reward function spec of each sample.
        outcomes: one ``TaskOutcome`` per sample (``status`` ok/timeout/error, ``error`` text).
        failure_score: the score failed samples got (for the message).
        max_failure_rate: the largest tolerated share of failed samples, in [0, 1].
        log_chars: characters of a response shown.
    """
    failed = [i for i, o in enumerate(outcomes) if o.status != "ok"]
    if not failed:
        return
    n = len(outcomes)
    errors = sum(outcomes[i].status == "error" for i in failed)
    timeouts = len(failed) - errors
    first = failed[0]
    for i in failed:
        logger.debug(
            "reward %s for %s: %s",
            outcomes[i].status,
            _describe(i, rows[i], specs[i], log_chars),
            _first_line(outcomes[i].error),
        )
    counts = f"{len(failed)} of {n} samples failed ({errors} errors, {timeouts} timeouts)"
    if len(failed) > max_failure_rate * n:
        raise RewardFailureError(
            f"reward: {counts}, more than reward.max_failure_rate = {max_failure_rate:g} of them; "
            "stopping instead of training on failure scores. First failure: "
            f"{_describe(first, rows[first], specs[first], log_chars)}:\n"
            f"{(outcomes[first].error or '').rstrip()}"
        )
    logger.warning(
        "reward: %s, scored %s; first: %s: %s",
        counts,
        failure_score,
        _describe(first, rows[first], specs[first], log_chars),
        _first_line(outcomes[first].error),
    )
