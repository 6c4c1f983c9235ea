"""Scoring where the rows are (``reward.placement=workers``).

With the reward on the driver, every generated response travels to the driver to be
decoded and scored. With ``reward.placement=workers`` the ``reward`` stage makes a group call
on the actor's workers instead (``ActorRolloutRefWorker.score``): each rank scores its share of
the rows with a :class:`RewardManager` of its own (same config, same tokenizer, same reward
table and user function, its own process pool) — in ``trainer.mode=sync`` the very rows it
generated, so no response moves — and answers three per-row scalars:

- ``scores [B]`` float32: the reward function's score (``failure_score`` where it failed);
- ``acc [B]`` float32: the function's ``acc`` extra, NaN where it returned none;
- ``reward_status [B]`` int: 0 ok, 1 timeout, 2 error;

and, when a row failed, the first failure's description in ``meta``. The response ids stay
on the workers; a driver stage that decodes them (a reward model's) reads ``batch["responses"]``.

The driver (:func:`collect_worker_scores`) turns the answer into exactly what it makes of a
driver-side call: ``acc`` is the verifier's where every row has one, else ``scores > 0``;
``reward/timeouts`` and ``reward/errors`` count the whole batch, and the whole batch's failure
share is held against ``reward.max_failure_rate`` (a rank logs its own failures but never stops
on its share alone).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from verity.batch import Batch, register_key
from verity.rewards.failures import RewardFailureError
from verity.rewards.manager import RewardManager, RewardManagerConfig
from verity.rewards.registry import custom_spec_from

__all__ = [
    "FIRST_FAILURE",
    "SCORING_KEYS",
    "STATUS_CODES",
    "check_reward_files_here",
    "collect_worker_scores",
    "score_on_worker",
    "scoring_request",
    "worker_reward_manager",
]

SCORING_KEYS = (
    "responses",
    "response_mask",
    "response_attention",
    "response_text",
    "data_source",
    "ground_truth",
    "extra_info",
    "trajectory",
)
"""What :meth:`RewardManager.score` reads of generated rows (where present): the scoring call sends these."""

FIRST_FAILURE = "reward_first_failure"
"""``batch.meta`` key of a worker's answer: the first failed sample, described, with its traceback."""

STATUS_CODES = {"ok": 0, "timeout": 1, "error": 2}

register_key(
    "reward_status",
    ("B",),
    "int",
    "how the sample's reward function ended on the worker that scored it: 0 ok, 1 timeout, 2 error",
)


def scoring_request(rows: Batch) -> Batch:
    """The part of generated ``rows`` a scoring call sends: :data:`SCORING_KEYS`, where present."""
    return rows.select(*(key for key in SCORING_KEYS if key in rows))


def check_reward_files_here(config: Any) -> None:
    """Raise, naming this node, when a reward function file the run names (``reward.custom_path``,
    a ``reward.overrides`` value ``FILE.py:function``) is not a file here.

    A rank that scores its rows (``reward.placement=workers``) loads them itself; on a cluster the
    driver's copy is not enough. Checked where the rank is built, before any step runs; nothing
    is imported.
    """
    import socket

    base = RewardManagerConfig.from_any(config)
    specs = [(f"reward.overrides.{source}", spec) for source, spec in base.overrides.items()]
    if base.custom_path:
        specs.append(("reward.custom_path", custom_spec_from(base.custom_path, base.custom_name)))
    for key, spec in specs:
        path = spec.rpartition(":")[0]  # what the loader reads as a file: a .py name or a path with "/"
        if (path.endswith(".py") or "/" in path) and not Path(path).expanduser().is_file():
            raise FileNotFoundError(
                f"reward.placement=workers: {key}={path!r} is not a file on node {socket.gethostname()}, "
                "where a rollout rank scores its rows; put the file at the same path on every node "
                "(a shared file system) or set reward.placement=driver"
            )


def worker_reward_manager(config: Any, tokenizer: Any) -> RewardManager:
    """The reward manager a rollout rank scores with: the run's ``reward`` config, never stopping on
    the rank's own failure share (the driver holds the whole batch's share against the limit)."""
    base = RewardManagerConfig.from_any(config)
    return RewardManager(dataclasses.replace(base, max_failure_rate=1.0), tokenizer=tokenizer)


def score_on_worker(manager: RewardManager, rows: Batch) -> Batch:
    """``scores [B]``, ``acc [B]`` and ``reward_status [B]`` of generated ``rows`` (a new batch).

    ``rows`` carry ``responses [B, R]`` with their mask and the non-tensor ``data_source``,
    ``ground_truth`` (and ``extra_info``) of each row, as a driver-side call reads them
    (:func:`scoring_request`). The first failure's description, if a row failed, is in the
    answer's ``meta[FIRST_FAILURE]``.
    """
    missing = [k for k in ("data_source", "ground_truth") if k not in rows.non_tensors]
    if missing:
        raise ValueError(
            f"reward.placement=workers: the rows sent to be scored carry no {' / '.join(missing)} "
            f"(keys: {rows.keys()}); generate from prompts with the reward columns, or set "
            "reward.placement=driver"
        )
    scores, extra, _ = manager.score(rows)
    n = len(rows)
    acc = [float(a) if a is not None else float("nan") for a in extra.get("acc", [None] * n)]
    status = [STATUS_CODES[s] for s in extra["reward_status"]]
    meta = {FIRST_FAILURE: manager.last_failure} if manager.last_failure is not None else {}
    return Batch.from_dict(
        {
            "scores": scores.to(torch.float32),
            "acc": torch.tensor(acc, dtype=torch.float32),
            "reward_status": torch.tensor(status, dtype=torch.int8),
        },
        meta=meta,
    )


def collect_worker_scores(
    batch: Batch, max_failure_rate: float, first_failure: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(scores [B], acc [B], metrics)`` of rows the workers scored, as the driver-side reward stage gives them.

    Raises :class:`RewardFailureError` when more than ``max_failure_rate`` of the rows failed,
    quoting ``first_failure`` (the answer's ``meta[FIRST_FAILURE]``).
    """
    scores = batch["scores"].to(torch.float32)
    acc = batch["acc"].to(torch.float32)
    if torch.isnan(acc).any():
        acc = (scores > 0).float()
    status = batch["reward_status"]
    timeouts = int((status == STATUS_CODES["timeout"]).sum())
    errors = int((status == STATUS_CODES["error"]).sum())
    n = len(batch)
    if timeouts + errors > max_failure_rate * n:
        raise RewardFailureError(
            f"reward: {timeouts + errors} of {n} samples failed ({errors} errors, {timeouts} timeouts) on the "
            f"rollout workers (reward.placement=workers), more than reward.max_failure_rate = "
            f"{max_failure_rate:g} of them; stopping instead of training on failure scores. First failure: "
            f"{first_failure or '(not described)'}"
        )
    return scores, acc, {"reward/timeouts": float(timeouts), "reward/errors": float(errors)}
