"""Request-level generation: requests join and leave an engine's decode batch one by one.

A :class:`RequestScheduler` is an engine's continuous-batching side. Its user (the agent
loop, :mod:`verity.rollout.agent.loop`) adds a request the moment its context is ready
and calls :meth:`RequestScheduler.step` while any request is held; each step advances
every held request by at least one decode step and returns those that finished::

    scheduler = engine.request_scheduler(params)      # params: the call's SamplingParams (n=1)
    scheduler.add(GenerationRequest(7, context_ids, max_new_tokens=64))
    while scheduler.pending():
        for done in scheduler.step():                  # FinishedRequest(7, token_ids, logprobs, ...)
            ...                                        # e.g. start its tool calls, add its next turn

Every :class:`~verity.rollout.base.RolloutEngine` has one:
:meth:`RolloutEngine.request_scheduler` defaults to :class:`BatchedCallScheduler`, which runs
one ``generate`` call over the requests queued at each step (so a plug-in engine works
unchanged, one call at a time); engines that decode step by step (HF, vLLM) return a
scheduler that adds and retires rows between decode steps.

A finished request's tokens end with the engine's stop token when it stopped on one, and
are at most ``max_new_tokens`` long; its log-probs are the sampler's, one per token.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from verity.rollout.prompts import left_pad
from verity.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from verity.rollout.base import RolloutEngine

__all__ = [
    "BatchedCallScheduler",
    "FinishedRequest",
    "GenerationRequest",
    "RequestScheduler",
    "checked_context",
]


@dataclass(frozen=True)
class GenerationRequest:
    """One request: continue ``context`` (token ids, no padding) by at most ``max_new_tokens``."""

    request_id: int
    context: Sequence[int]
    max_new_tokens: int


@dataclass(frozen=True)
class FinishedRequest:
    """What a request produced: ``token_ids`` and the sampler's ``logprobs`` (nats), one per token."""

    request_id: int
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)


def checked_context(request: GenerationRequest, max_model_len: int) -> list[int]:
    """``request``'s context as a list of ints, after checking it fits an engine of ``max_model_len``
    tokens (prompt + response). Raises ValueError naming the request: ``max_new_tokens`` < 1, an
    empty context, or context + ``max_new_tokens`` > ``max_model_len``."""
    context = [int(t) for t in request.context]
    if request.max_new_tokens < 1:
        raise ValueError(
            f"request {request.request_id}: max_new_tokens must be >= 1, got {request.max_new_tokens}"
        )
    if not context:
        raise ValueError(f"request {request.request_id}: the context is empty")
    if len(context) + request.max_new_tokens > max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len}: request {request.request_id}'s context ({len(context)} tokens) plus "
            f"max_new_tokens={request.max_new_tokens} does not fit; raise max_model_len or shorten the context"
        )
    return context


class RequestScheduler(abc.ABC):
    """Holds requests and advances them together (see the module docstring)."""

    @abc.abstractmethod
    def add(self, request: GenerationRequest) -> None:
        """Hold ``request``; it joins the decode batch at the next :meth:`step`."""

    @abc.abstractmethod
    def step(self) -> list[FinishedRequest]:
        """Advance every held request by at least one decode step; return the ones that finished."""

    @abc.abstractmethod
    def pending(self) -> int:
        """How many requests are held (added and not yet returned by :meth:`step`)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the scheduler holds (caches); it is not used after this."""


class BatchedCallScheduler(RequestScheduler):
    """Any engine as a scheduler: each :meth:`step` is one ``generate`` call over every queued request.

    Requests added while a call runs wait for the next one; every request of a call finishes
    in it. Tokens are cut to each request's own ``max_new_tokens`` (sampling at most ``k``
    tokens is the same as sampling more and keeping ``k``).
    """

    def __init__(self, engine: RolloutEngine, params: SamplingParams, pad_token_id: int) -> None:
        self.engine = engine
        self.params = params
        self.pad_token_id = pad_token_id
        self._queue: list[GenerationRequest] = []

    def add(self, request: GenerationRequest) -> None:
        """Queue ``request`` for the next call."""
        self._queue.append(request)

    def pending(self) -> int:
        """Requests queued for the next call."""
        return len(self._queue)

    def step(self) -> list[FinishedRequest]:
        """One ``generate`` call over the queued requests; all of them finish."""
        if not self._queue:
            return []
        queue, self._queue = self._queue, []
        input_ids, attention_mask = left_pad([list(r.context) for r in queue], self.pad_token_id)
        new_tokens = max(r.max_new_tokens for r in queue)
        out = self.engine.generate(
            {"input_ids": input_ids, "attention_mask": attention_mask},
            replace(self.params, n=1, max_new_tokens=new_tokens),
        )
        responses: torch.Tensor = out["responses"].cpu()
        lengths = out["response_mask"].cpu().sum(-1)
        logprobs: torch.Tensor = out["rollout_logprobs"].cpu()
        finished = []
        for row, request in enumerate(queue):
            keep = min(int(lengths[row]), request.max_new_tokens)
            finished.append(
                FinishedRequest(
                    request.request_id, responses[row, :keep].tolist(), logprobs[row, :keep].tolist()
                )
            )
        return finished
