"""Scoring where the rows are made (``reward.placement=workers``).

With the reward on the driver, every generated response travels to the driver to be
decoded and scored. With ``reward.placement=workers`` each rollout rank scores the rows
it generated, right after generating them, with a :class:`RewardManager` of its own (same
config, same tokenizer, same reward table and user function, its own process pool); the
answer to the driver then carries three per-row scalars in place of the responses:

- ``scores [B]`` float32: the reward function's score (``failure_score`` where it failed);
- ``acc [B]`` float32: the function's ``acc`` extra, NaN where it returned none;
- ``reward_status [B]`` int: 0 ok, 1 timeout, 2 error.

and, when a row failed, the first failure's description in ``meta``. The response ids stay
in the rank's object store with the prompt side (:mod:`verity.batch.transport`); a driver
stage that decodes them (a reward model's) reads ``batch["responses"]`` and so fetches them.

The driver's ``reward`` stage (:func:`scored_on_workers`) turns them into exactly what it
makes of a driver-side call: ``acc`` is the verifier's where every row has one, else
``scores > 0``; ``reward/timeouts`` and ``reward/errors`` count the whole batch, and the
whole batch's failure share is held against ``reward.max_failure_rate`` (a rank logs its
own failures but never stops on its share alone).
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
    "SCORER_COLUMNS",
    "SCORE_ON_WORKERS",
    "STATUS_CODES",
    "ask_ranks_to_score",
    "check_reward_files_here",
    "collect_worker_scores",
    "score_on_worker",
    "scored_on_workers",
    "worker_reward_manager",
]

SCORE_ON_WORKERS = "score_on_workers"
"""``batch.meta`` flag of a generate call: score the generated rows on the rank that made them."""

SCORER_COLUMNS = ("data_source", "ground_truth", "extra_info")
"""The prompt columns a reward function reads: sent with a generate call that asks the ranks to score."""

FIRST_FAILURE = "reward_first_failure"
"""``batch.meta`` key of a worker's answer: the first failed sample, described, with its traceback."""

STATUS_CODES = {"ok": 0, "timeout": 1, "error": 2}

register_key(
    "reward_status",
    ("B",),
    "int",
    "how the sample's reward function ended on the worker that scored it: 0 ok, 1 timeout, 2 error",
)


def ask_ranks_to_score(rows: Batch) -> Batch:
    """Mark a generate call's ``rows`` (in place, :data:`SCORE_ON_WORKERS`) to be scored by the
    ranks that generate them. Returns ``rows``."""
    rows.meta[SCORE_ON_WORKERS] = True
    return rows


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
    """Score the generated ``rows`` in place: adds ``scores [B]``, ``acc [B]`` and ``reward_status [B]``.

    ``rows`` carry ``responses [B, R]`` with their mask and the non-tensor ``data_source``,
    ``ground_truth`` (and ``extra_info``) of each row, as a driver-side call reads them.
    """
    missing = [k for k in ("data_source", "ground_truth") if k not in rows.non_tensors]
    if missing:
        raise ValueError(
            f"reward.placement=workers: the generate call asked this rank to score its rows, but they "
            f"carry no {' / '.join(missing)} (keys: {rows.keys()}); send prompts with the reward "
            "columns (verity.rewards.on_workers.ask_ranks_to_score) or set reward.placement=driver"
        )
    scores, extra, _ = manager.score(rows)
    n = len(rows)
    acc = [float(a) if a is not None else float("nan") for a in extra.get("acc", [None] * n)]
    rows["scores"] = scores.to(torch.float32)
    rows["acc"] = torch.tensor(acc, dtype=torch.float32)
    rows["reward_status"] = torch.tensor([STATUS_CODES[s] for s in extra["reward_status"]], dtype=torch.int8)
    if manager.last_failure is not None:
        rows.meta[FIRST_FAILURE] = manager.last_failure
    return rows


def scored_on_workers(batch: Batch) -> bool:
    """Whether ``batch``'s rows were scored by the workers that generated them."""
    return "reward_status" in batch.tensor_keys()


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
