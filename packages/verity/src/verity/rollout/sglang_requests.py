"""Request-level generation on SGLang: each request is one ``Engine.async_generate`` call of its own.

:class:`SGLangRequestScheduler` is what :meth:`SGLangRollout.request_scheduler` returns. SGLang's
scheduler process batches whatever requests it holds (continuous batching), so the scheduler
only has to hand requests over and collect them: :meth:`~SGLangRequestScheduler.add` starts one
``async_generate(input_ids=..., sampling_params=..., return_logprob=True, rid=...)`` coroutine as
a task on the engine's event loop (``Engine.loop``, the loop its own ``generate`` runs on), and
:meth:`~SGLangRequestScheduler.step` runs that loop until at least one held request has finished
and returns every finished one. Requests keep decoding in SGLang's process between steps.

Per-request sampling dicts are the ones :meth:`SGLangRollout.generate` sends
(:func:`~verity.rollout.sglang_rollout.sglang_request_params`, ``max_new_tokens`` the request's
own); with ``enable_deterministic_inference`` a sampled request gets a ``sampling_seed`` drawn
from the rollout's seed stream when it is added. While the scheduler holds requests the rollout
refuses ``generate``, ``load_weights`` and ``sleep``; an asleep rollout refuses ``add`` and ``step``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from verity.rollout.requests import FinishedRequest, GenerationRequest, RequestScheduler, checked_context
from verity.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from verity.rollout.sglang_rollout import SGLangRollout

__all__ = ["SGLangRequestScheduler", "finished_from_sglang"]

_RIDS = itertools.count()


class SGLangRequestScheduler(RequestScheduler):
    """Requests handed to ``rollout``'s SGLang engine one by one (module docstring).

    ``params``: every request's sampling parameters (``n`` must be 1; ``max_new_tokens`` is each
    request's own). Raises RuntimeError when the rollout is closed.
    """

    def __init__(self, rollout: SGLangRollout, params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError(
                f"request_scheduler: params.n must be 1 (one sample per request), got {params.n}"
            )
        engine = rollout._engine()
        self.rollout = rollout
        self.params = params
        self.loop: asyncio.AbstractEventLoop = getattr(engine, "loop", None) or asyncio.new_event_loop()
        self._tasks: dict[asyncio.Task, tuple[int, str]] = {}  # task -> (the caller's id, SGLang's rid)
        self._closed = False

    def add(self, request: GenerationRequest) -> None:
        """Start ``request`` in SGLang's engine (it decodes from the next :meth:`step` on).

        Raises ValueError when its context plus ``max_new_tokens`` exceeds the rollout's
        ``max_model_len`` or ``max_new_tokens`` < 1; RuntimeError when the engine is asleep.
        """
        self._check_usable("add")
        context = checked_context(request, self.rollout.max_model_len)
        self.rollout._claim_scheduler(self)
        params = replace(self.params, max_new_tokens=request.max_new_tokens)
        (sampling,) = self.rollout._request_params(params, 1)
        rid = f"verity-{next(_RIDS)}"
        coroutine = self.rollout._engine().async_generate(
            input_ids=context, sampling_params=sampling, return_logprob=True, rid=rid
        )
        self._tasks[self.loop.create_task(coroutine)] = (request.request_id, rid)

    def step(self) -> list[FinishedRequest]:
        """Run the engine's loop until at least one held request finished; return the finished ones,
        in the order they were added. Raises the engine's error for a request that failed."""
        if not self._tasks:
            return []
        self._check_usable("step")
        held = list(self._tasks)
        self.loop.run_until_complete(asyncio.wait(held, return_when=asyncio.FIRST_COMPLETED))
        finished = []
        for task in held:
            if not task.done():
                continue
            request_id, _ = self._tasks.pop(task)
            finished.append(finished_from_sglang(request_id, task.result()))
        if not self._tasks:
            self.rollout._release_scheduler(self)
        return finished

    def pending(self) -> int:
        """Requests added and not yet returned by :meth:`step`."""
        return len(self._tasks)

    def close(self) -> None:
        """Abort the requests still held (idempotent); the rollout is free for other calls after it."""
        if self._closed:
            return
        self._closed = True
        engine = getattr(self.rollout, "engine", None)
        abort = getattr(getattr(engine, "tokenizer_manager", None), "abort_request", None)
        for task, (_, rid) in self._tasks.items():
            if callable(abort):
                abort(rid)
            task.cancel()
        if self._tasks:
            self.loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
        self._tasks.clear()
        self.rollout._release_scheduler(self)

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"SGLangRequestScheduler.{what}: the scheduler was closed")
        self.rollout._engine()
        if self.rollout._asleep:
            raise RuntimeError(f"SGLangRequestScheduler.{what}: the engine is asleep; call wake() first")


def finished_from_sglang(request_id: int, output: Mapping[str, Any]) -> FinishedRequest:
    """One ``async_generate`` result as a :class:`FinishedRequest`: ``output_ids`` and, per token, the
    log-prob in ``meta_info["output_token_logprobs"]`` (``(logprob, token_id, text)`` entries).

    Raises RuntimeError when the log-prob entries' token ids differ from ``output_ids``.
    """
    ids = [int(t) for t in output["output_ids"]]
    entries = output["meta_info"]["output_token_logprobs"]
    if [int(e[1]) for e in entries] != ids:
        raise RuntimeError(f"SGLang request {request_id}: log-prob token ids do not match output_ids")
    return FinishedRequest(request_id, ids, [float(e[0]) for e in entries])
