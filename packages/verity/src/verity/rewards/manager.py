"""RewardManager: score a batch of responses with rule rewards, in worker processes, never stalling.

For every sample the manager picks a reward function by ``data_source``
(:func:`verity.rewards.registry.resolve_spec`), then runs all of them in a
:class:`~verity.rewards.process_pool.TimeoutPool`. A sample whose function
times out, raises, returns a non-score or kills its worker gets
``failure_score`` (default 0.0); it is counted in ``reward/timeouts`` or
``reward/errors`` and marked in ``extra["reward_status"]``; the call logs one
summary of its failures (logger ``verity.rewards``, :mod:`verity.rewards.failures`).
A hung worker is killed at the timeout and replaced, and hung samples time out in
parallel (the pool widens to ``max_workers``). A sample's timeout counts only its own
scoring: before a call sends samples to the pool, every worker loads the reward functions
the call needs that it has not loaded yet (a plug-in's task, a user module), under the
pool's start-up limit (:attr:`TimeoutPool.startup_timeout_s <verity.rewards.process_pool.TimeoutPool>`,
120 s) instead of any sample's timeout; a pool that cannot start raises RuntimeError naming what
it was loading. When more than ``max_failure_rate``
of a call's samples fail, :meth:`RewardManager.score` raises
:class:`~verity.rewards.failures.RewardFailureError` with the first traceback.

``num_workers=0`` scores in the calling process instead (no timeouts: only for
trusted, fast functions, e.g. in a debugger).

The manager can live in the trainer's driver process or inside a Ray actor
(the pool uses ``forkserver``, which is safe from threaded parents). It pickles
without its pool, so it can be shipped to an actor and starts its own there.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import compress
from typing import Any

import torch

from verity.rewards.failures import describe_first_failure, report_failures
from verity.rewards.process_pool import TaskOutcome, TimeoutPool
from verity.rewards.registry import call_reward, custom_spec_from, preload_reward_functions, resolve_spec

_PRELOAD = (
    "verity.rewards.process_pool",
    "verity.rewards.registry",
    "verity.rewards.builtin",
    "verity.rewards.code",
    "math_verify",
)


INLINE_SPECS: frozenset[str] = frozenset({"gsm8k_strict", "gsm8k_flexible", "math_boxed", "dapo", "aime"})
"""Built-in verifiers that are bounded string checks of our own: safe to run without a timeout."""


def runs_inline(spec: str) -> bool:
    """Whether ``spec`` is a built-in string verifier or an embedded task (scored in-process when allowed)."""
    return spec in INLINE_SPECS or spec.startswith("task:")


@dataclass
class RewardManagerConfig:
    """How rewards are computed.

    ``num_workers``: reward processes (0: score in the calling process, without timeouts);
    ``timeout_s``: seconds one sample may take; ``timeout_overrides``: per ``data_source``;
    ``failure_score``: the score of a sample that timed out or failed;
    ``custom_path``/``custom_name``: a user reward function (a ``.py`` file or a module, and
    the function name) used for every data source; ``custom_kwargs``: extra keyword
    arguments passed to it; ``overrides``: ``{data_source: spec}`` replacing the default table;
    ``start_method``: multiprocessing start method of the pool; ``skip_special_tokens``:
    when decoding response ids; ``log_chars``: how much of a failing response to log;
    ``max_failure_rate``: the largest share of a call's samples that may fail (error or
    timeout) before scoring raises (1.0: never); ``max_workers``: processes the pool may
    widen to while samples hang (None: ``max(num_workers, 16)``); ``inline_builtin``: score
    the specs in :data:`INLINE_SPECS` and the embedded tasks (``task:*``) in the calling
    process — bounded string checks that take microseconds, where a pool round trip
    costs milliseconds — while user functions, ``math_verify`` and code still go to the pool
    with their timeouts.
    """

    num_workers: int = 1
    timeout_s: float = 10.0
    failure_score: float = 0.0
    custom_path: str | None = None
    custom_name: str = "compute_score"
    custom_kwargs: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)
    timeout_overrides: dict[str, float] = field(default_factory=dict)
    start_method: str = "forkserver"
    skip_special_tokens: bool = True
    log_chars: int = 400
    max_failure_rate: float = 0.5
    max_workers: int | None = None
    inline_builtin: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"reward num_workers: expected an int >= 0, got {self.num_workers!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward timeout_s: expected > 0 seconds, got {self.timeout_s!r}")
        for source, seconds in self.timeout_overrides.items():
            if not seconds > 0:
                raise ValueError(
                    f"reward timeout_overrides[{source!r}]: expected > 0 seconds, got {seconds!r}"
                )
        if not 0.0 <= float(self.max_failure_rate) <= 1.0:
            raise ValueError(
                f"reward max_failure_rate: expected a share in [0, 1], got {self.max_failure_rate!r}"
            )
        if self.max_workers is not None and (
            not isinstance(self.max_workers, int) or self.max_workers < max(1, self.num_workers)
        ):
            raise ValueError(
                f"reward max_workers: expected null or an int >= num_workers ({self.num_workers}), "
                f"got {self.max_workers!r}"
            )
        if not math.isfinite(float(self.failure_score)):
            raise ValueError(f"reward failure_score: expected a finite number, got {self.failure_score!r}")

    @classmethod
    def from_any(cls, config: Any) -> RewardManagerConfig:
        """Build from None, this class, a mapping, or any object with matching attributes.

        Also accepts a nested ``custom_reward`` with ``path``/``name``/``kwargs`` (verl style).
        """
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        get = (
            config.get
            if isinstance(config, Mapping)
            else lambda key, default=None: getattr(config, key, default)
        )
        values: dict[str, Any] = {}
        for item in fields(cls):
            value = get(item.name, None)
            if value is not None:
                values[item.name] = dict(value) if isinstance(value, Mapping) else value
        custom = get("custom_reward", None)
        if custom is not None:
            cget = custom.get if isinstance(custom, Mapping) else lambda k, d=None: getattr(custom, k, d)
            if cget("path", None):
                values["custom_path"] = cget("path")
                values["custom_name"] = cget("name", None) or "compute_score"
                values["custom_kwargs"] = dict(cget("kwargs", None) or {})
        return cls(**values)


def _cleanup_after_killed_worker(pid: int) -> None:
    from verity.rewards.sandbox import cleanup_after_worker

    cleanup_after_worker(pid)


def _column(batch: Any, key: str, *, held_here: bool = False) -> Any:
    """``batch[key]`` for a Batch or a mapping; None when absent. ``held_here``: None also when the
    key stayed on the workers that generated the rows (``Batch.resident_keys``) rather than fetch it."""
    keys = batch.keys() if hasattr(batch, "keys") else ()
    if held_here and key in (batch.resident_keys() if hasattr(batch, "resident_keys") else ()):
        return None
    if key in keys or key in getattr(batch, "non_tensors", {}):
        return batch[key]
    return None


class RewardManager:
    """Scores responses with rule rewards (see the module docstring).

    Args:
        config: a :class:`RewardManagerConfig`, a mapping, or an object with those
            attributes (e.g. the run config's ``reward`` section); None for defaults.
        tokenizer: decodes ``responses`` token ids when a batch carries no
            ``response_text``.
    """

    def __init__(self, config: Any = None, tokenizer: Any = None) -> None:
        self.config = RewardManagerConfig.from_any(config)
        self.tokenizer = tokenizer
        self._custom_spec = custom_spec_from(self.config.custom_path, self.config.custom_name)
        self._pool: TimeoutPool | None = None
        self._warmed: set[str] = set()  # specs every worker of the pool has loaded
        self.last_failure: str | None = None
        """The first failed sample of the last :meth:`score` call, described with its traceback (None: none failed)."""

    # -- lifecycle -------------------------------------------------------------------------------
    def _get_pool(self) -> TimeoutPool:
        if self._pool is None:
            self._pool = TimeoutPool(
                self.config.num_workers,
                start_method=self.config.start_method,
                preload=_PRELOAD,
                on_worker_killed=_cleanup_after_killed_worker,
                initializer=(preload_reward_functions, (self._warm_specs(),)),
                max_workers=self.config.max_workers,
            )
            self._warmed = set(self._warm_specs())
        return self._pool

    def _pool_with(self, specs: Sequence[str]) -> TimeoutPool:
        """The pool, its workers started and holding the functions ``specs`` name (loading them
        is start-up, bounded by the pool's start-up limit, not by any sample's timeout)."""
        pool = self._get_pool()
        new = tuple(spec for spec in dict.fromkeys(specs) if spec not in self._warmed)
        if new:
            try:
                pool.warm_up(preload_reward_functions, (new,))
            except RuntimeError as error:  # the pool is closed: a later call starts a new one
                self.close()
                raise RuntimeError(
                    f"reward workers could not start with {list(new)} loaded: {error}"
                ) from error
            self._warmed.update(new)
        return pool

    def _warm_specs(self) -> tuple[str, ...]:
        """Reward functions every worker loads at start-up: the user function and the overrides."""
        specs = [self._custom_spec] if self._custom_spec else []
        return tuple(specs + sorted(set(self.config.overrides.values())))

    def close(self) -> None:
        """Stop the worker processes (a later :meth:`score` starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
            self._warmed = set()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pool"] = None
        state["_warmed"] = set()
        return state

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    # -- inputs ----------------------------------------------------------------------------------
    def _decode(self, batch: Any) -> list[str]:
        responses = _column(batch, "responses")
        if responses is None:
            raise ValueError("batch: needs 'response_text' (list of str) or 'responses' token ids [B, R]")
        if self.tokenizer is None:
            raise ValueError("RewardManager: decoding 'responses' needs a tokenizer (pass tokenizer=...)")
        mask = response_span(batch)
        if mask is None:
            mask = torch.ones_like(responses)
        # one conversion of each tensor to lists, then a filter per row: indexing a tensor per row
        # is slower (ci/reports/2026-12-06-docstring-figures.md)
        ids = [list(compress(row, keep)) for row, keep in zip(responses.tolist(), mask.tolist(), strict=True)]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=self.config.skip_special_tokens)

    def _rows_from_batch(self, batch: Any) -> list[dict[str, Any]]:
        texts = _column(batch, "response_text")
        if texts is None:
            texts = self._decode(batch)
        sources = _column(batch, "data_source")
        truths = _column(batch, "ground_truth")
        if sources is None or truths is None:
            raise ValueError("batch: needs non-tensor lists 'data_source' and 'ground_truth' of length B")
        extras = _column(batch, "extra_info")
        if extras is None:
            extras = [None] * len(texts)
        trajectories = _column(batch, "trajectory")
        if trajectories is not None:
            # multi-turn rollouts: the reward function reads the turns as extra_info["trajectory"]
            # (a copy per row: the n samples of a prompt share one extra_info dict)
            extras = [
                {**(e if isinstance(e, Mapping) else {}), "trajectory": t}
                for e, t in zip(extras, trajectories, strict=True)
            ]
        if not len(texts) == len(sources) == len(truths) == len(extras):
            raise ValueError(
                f"batch: response_text/data_source/ground_truth/extra_info lengths differ: "
                f"{len(texts)}/{len(sources)}/{len(truths)}/{len(extras)}"
            )
        return [
            {"data_source": s, "solution_str": t, "ground_truth": g, "extra_info": e}
            for t, s, g, e in zip(texts, sources, truths, extras, strict=True)
        ]

    @staticmethod
    def _normalize_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, row in enumerate(rows):
            text = row.get("solution_str", row.get("response_text", row.get("response")))
            truth = row.get("ground_truth")
            if truth is None and isinstance(row.get("reward_model"), Mapping):
                truth = row["reward_model"].get("ground_truth")
            if not isinstance(text, str):
                raise ValueError(f"rows[{i}]: needs 'solution_str' (or 'response_text'/'response') as str")
            if not isinstance(row.get("data_source"), str):
                raise ValueError(f"rows[{i}]: needs 'data_source' as str, got {row.get('data_source')!r}")
            out.append(
                {
                    "data_source": row["data_source"],
                    "solution_str": text,
                    "ground_truth": truth,
                    "extra_info": row.get("extra_info"),
                }
            )
        return out

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, batch_or_rows: Any) -> tuple[torch.Tensor, dict[str, list], dict[str, float]]:
        """Score every sample.

        Input: a ``Batch``/mapping with non-tensors ``data_source``, ``ground_truth``,
        optional ``extra_info``, and either ``response_text`` (list of str) or
        ``responses`` [B, R] with ``attention_mask`` [B, P+R] or ``response_mask`` [B, R]
        (decoded with the tokenizer over :func:`response_span`: in multi-turn rollouts
        the tool answers are part of the text, as in verl); or a list of row dicts with
        ``data_source``, ``solution_str``, ``ground_truth``, optional ``extra_info``. A
        per-row ``trajectory`` (the agent loop's) reaches each reward function as
        ``extra_info["trajectory"]``.

        Returns ``(scores [B] float32, extra, metrics)``: ``extra`` maps every extra key a
        reward function returned (e.g. ``acc``, ``pred``) plus ``reward_status``
        (``ok``/``timeout``/``error``) and ``reward_error`` to a list of length B (None
        where absent); ``metrics`` has ``reward/mean``, ``reward/timeouts``,
        ``reward/errors``, ``reward/<data_source>/mean`` and the mean of each numeric extra
        as ``reward/<key>``.
        """
        if isinstance(batch_or_rows, Sequence) and not isinstance(batch_or_rows, str | bytes):
            rows = self._normalize_rows(batch_or_rows)
        else:
            rows = self._rows_from_batch(batch_or_rows)
        # one lookup per data source, not per sample (a batch holds a few sources)
        by_source = {
            source: resolve_spec(source, self.config.overrides, self._custom_spec)
            for source in dict.fromkeys(r["data_source"] for r in rows)
        }
        specs = [by_source[r["data_source"]] for r in rows]
        kwargs = dict(self.config.custom_kwargs) if self._custom_spec else {}
        tasks = [
            (spec, r["data_source"], r["solution_str"], r["ground_truth"], r["extra_info"], kwargs)
            for spec, r in zip(specs, rows, strict=True)
        ]
        timeouts = [self.config.timeout_overrides.get(r["data_source"], self.config.timeout_s) for r in rows]
        if self.config.num_workers == 0:
            outcomes = [self._run_inline(task) for task in tasks]
        else:
            outcomes = self._score_split(tasks, timeouts, specs)
        return self._collect(rows, specs, outcomes)

    def _score_split(self, tasks: list[tuple], timeouts: list[float], specs: list[str]) -> list[TaskOutcome]:
        """Inline-safe specs in this process, every other one in the pool; outcomes in input order."""
        inline_by_spec = {
            spec: self.config.inline_builtin and runs_inline(spec) for spec in dict.fromkeys(specs)
        }
        inline = [inline_by_spec[spec] for spec in specs]
        outcomes: list[TaskOutcome | None] = [
            self._run_inline(task) if here else None for task, here in zip(tasks, inline, strict=True)
        ]
        pooled = [i for i, here in enumerate(inline) if not here]
        if pooled:
            results = self._pool_with([specs[i] for i in pooled]).map(
                call_reward, [tasks[i] for i in pooled], [timeouts[i] for i in pooled]
            )
            for i, outcome in zip(pooled, results, strict=True):
                outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    @staticmethod
    def _run_inline(task: tuple) -> TaskOutcome:
        try:
            return TaskOutcome("ok", value=call_reward(*task))
        except Exception as error:  # any failure of a reward function is scored, not raised
            return TaskOutcome(
                "error", error=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
            )

    def _collect(
        self, rows: list[dict[str, Any]], specs: list[str], outcomes: list[TaskOutcome]
    ) -> tuple[torch.Tensor, dict[str, list], dict[str, float]]:
        n = len(rows)
        values = [float(self.config.failure_score)] * n
        extra: dict[str, list] = {"reward_status": [o.status for o in outcomes], "reward_error": [None] * n}
        for i, outcome in enumerate(outcomes):
            if outcome.status == "ok":
                values[i], extras = outcome.value
                for key, value in extras.items():
                    extra.setdefault(key, [None] * n)[i] = value
            else:
                extra["reward_error"][i] = outcome.error
        scores = torch.tensor(values, dtype=torch.float32)
        self.last_failure = describe_first_failure(rows, specs, outcomes, self.config.log_chars)
        report_failures(
            rows,
            specs,
            outcomes,
            failure_score=self.config.failure_score,
            max_failure_rate=self.config.max_failure_rate,
            log_chars=self.config.log_chars,
        )
        metrics: dict[str, float] = {
            "reward/mean": float(scores.mean()) if n else 0.0,
            "reward/timeouts": float(sum(o.status == "timeout" for o in outcomes)),
            "reward/errors": float(sum(o.status == "error" for o in outcomes)),
        }
        by_source: dict[str, list[float]] = {}
        for row, value in zip(rows, scores.tolist(), strict=True):
            by_source.setdefault(row["data_source"], []).append(value)
        for source, values in by_source.items():
            metrics[f"reward/{source}/mean"] = sum(values) / len(values)
        for key, values in extra.items():
            numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
            numbers += [float(v) for v in values if isinstance(v, bool)]
            if numbers and key not in ("reward_status", "reward_error"):
                metrics[f"reward/{key}"] = sum(numbers) / len(numbers)
        return scores, extra, metrics


def response_span(batch: Any) -> torch.Tensor | None:
    """``[B, R]`` 1 on every real response token: ``response_attention``, else ``attention_mask[:, -R:]``.

    It equals ``response_mask`` for single-turn rollouts; in multi-turn rollouts it also
    covers the tool answers between the model's turns, so the decoded response is the
    whole exchange (as verl decodes it). ``response_mask`` when the batch has neither
    (single-turn rows whose ``attention_mask`` stayed on the workers); None without any mask.
    """
    span = _column(batch, "response_attention")
    if span is not None:
        return span
    responses = _column(batch, "responses")
    attention = _column(batch, "attention_mask", held_here=True)  # not fetched for this: response_mask serves
    if responses is not None and attention is not None and attention.shape[1] >= responses.shape[1]:
        return attention[:, -responses.shape[1] :]
    return _column(batch, "response_mask")


def token_rewards_from_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on its last real response token.

    Args:
        scores: [B] sequence rewards.
        response_mask: [B, R], 1 on real response tokens (a prefix of each row), 0 after.

    Returns:
        token_rewards: [B, R] float32, zero except ``scores[b]`` at the last position where
        ``response_mask[b]`` is 1. A row with an empty response gets no reward anywhere.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores [B] and response_mask [B, R] expected, got {tuple(scores.shape)} and {tuple(response_mask.shape)}"
        )
    mask = response_mask.to(torch.bool)
    width = mask.shape[1]
    positions = torch.arange(width, device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_response = last >= 0
    rows = torch.nonzero(has_response, as_tuple=True)[0]
    token_rewards[rows, last[rows]] = scores.to(torch.float32).to(mask.device)[rows]
    return token_rewards
