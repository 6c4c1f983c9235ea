"""Request-level generation on vLLM: each request enters and leaves the engine's batch on its own.

:class:`VLLMRequestScheduler` is what :meth:`VLLMRollout.request_scheduler` returns. It uses
the engine the rollout already holds (``vllm.LLM``): :meth:`~VLLMRequestScheduler.add` enqueues
one ``TokensPrompt`` with its own sampling parameters (``LLM.enqueue``; vLLM's V1 engine starts
it at its next scheduler step, beside the requests already decoding), and
:meth:`~VLLMRequestScheduler.step` runs one step of vLLM's engine (``LLM.llm_engine.step``: one
scheduler iteration, every running request advanced by one token, new ones prefilled) and
returns the requests that finished in it.

Per-request sampling parameters are the ones :meth:`VLLMRollout.generate` builds
(``VLLMRollout._request_params``): ``max_tokens`` is the request's ``max_new_tokens``, the
rollout's EOS ids are the stop ids (none with ``ignore_eos``), ``logprobs=0`` (the sampled
token's log-prob), and a sampled request's seed is drawn from the rollout's seed stream when
it is added. Greedy requests through the scheduler give the tokens ``generate`` gives.

The engine is the rollout's, so the scheduler shares its state:

- while the scheduler holds requests, the rollout refuses ``generate``, ``load_weights`` and
  ``sleep`` (either would run or change the engine under requests in flight); one scheduler
  at a time holds requests;
- an asleep rollout (``sleep`` without ``wake``) refuses ``add`` and ``step``;
- on a tensor-parallel replica (``tp_mesh``, vLLM's external launcher), every rank runs its own
  scheduler: each :meth:`~VLLMRequestScheduler.step` first checks, with one all-gather over the
  replica, that every rank added the same requests with the same seeds since the last step
  (:func:`~verity.rollout.replica_lockstep.check_replica_lockstep`); ranks that differ raise
  instead of waiting on each other's collectives.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from verity.rollout.replica_lockstep import check_replica_lockstep
from verity.rollout.requests import FinishedRequest, GenerationRequest, RequestScheduler, checked_context
from verity.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from verity.rollout.vllm_rollout import VLLMRollout

__all__ = ["VLLMRequestScheduler", "external_request_id", "finished_from_output"]


class VLLMRequestScheduler(RequestScheduler):
    """Requests added to and retired from ``rollout``'s vLLM engine one by one (module docstring).

    ``params``: the sampling parameters of every request (``n`` must be 1; ``max_new_tokens``
    is each request's own). Raises RuntimeError when the rollout is closed or asleep, or
    another scheduler of the same rollout still holds requests.
    """

    def __init__(self, rollout: VLLMRollout, params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError(
                f"request_scheduler: params.n must be 1 (one sample per request), got {params.n}"
            )
        rollout._engine()  # raises when closed
        self.rollout = rollout
        self.params = params
        self._held: dict[str, int] = {}  # vLLM's (external) request id -> the caller's request id
        self._added: list[tuple[int, list[int], int, int | None]] = []  # since the last step, for lockstep
        self._closed = False

    # ------------------------------------------------------------------ the interface

    def add(self, request: GenerationRequest) -> None:
        """Enqueue ``request`` in vLLM's engine; it starts at the next :meth:`step`.

        Raises ValueError when its context plus ``max_new_tokens`` exceeds the rollout's
        ``max_model_len`` or ``max_new_tokens`` < 1; RuntimeError when the engine is asleep.
        """
        self._check_usable("add")
        context = checked_context(request, self.rollout.max_model_len)
        self.rollout._claim_scheduler(self)
        from vllm.inputs import TokensPrompt

        (vllm_params,) = self.rollout._request_params(
            replace(self.params, max_new_tokens=request.max_new_tokens), 1
        )
        llm = self.rollout._engine()
        (internal_id,) = llm.enqueue(TokensPrompt(prompt_token_ids=context), vllm_params, use_tqdm=False)
        self._held[external_request_id(internal_id)] = request.request_id
        self._added.append((request.request_id, context, request.max_new_tokens, vllm_params.seed))

    def step(self) -> list[FinishedRequest]:
        """One step of vLLM's engine; returns the requests that finished in it (possibly none)."""
        if not self._held:
            return []
        self._check_usable("step")
        if self.rollout.tp_mesh is not None:
            self._check_lockstep()
        self._added = []
        engine = self.rollout._engine().llm_engine
        with torch.random.fork_rng(devices=[]):  # vLLM's CPU sampler draws from the global RNG
            outputs = engine.step()
        finished = []
        for output in outputs:
            if not output.finished or output.request_id not in self._held:
                continue
            finished.append(finished_from_output(self._held.pop(output.request_id), output))
        if not self._held:
            self.rollout._release_scheduler(self)
        return finished

    def pending(self) -> int:
        """Requests added and not yet returned by :meth:`step`."""
        return len(self._held)

    def close(self) -> None:
        """Abort the requests still held (idempotent); the rollout is free for other calls after it."""
        if self._closed:
            return
        self._closed = True
        llm = getattr(self.rollout, "llm", None)
        if self._held and llm is not None:
            llm.llm_engine.abort_request(list(self._held))
        self._held.clear()
        self.rollout._release_scheduler(self)

    # ------------------------------------------------------------------ checks

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"VLLMRequestScheduler.{what}: the scheduler was closed")
        self.rollout._engine()
        if self.rollout._asleep:
            raise RuntimeError(f"VLLMRequestScheduler.{what}: the engine is asleep; call wake() first")

    def _check_lockstep(self) -> None:
        """Every rank of the replica added the same requests, with the same seeds, since the last step."""
        mesh = self.rollout.tp_mesh
        on_cuda = mesh.device_type == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu"
        parts = (repr((self._added, sorted(self.params.to_dict().items()))).encode(),)
        check_replica_lockstep(mesh, device, parts, "VLLMRequestScheduler")


def finished_from_output(request_id: int, output: Any) -> FinishedRequest:
    """A finished vLLM ``RequestOutput`` as a :class:`FinishedRequest`: its first sample's token ids
    and, per token, the sampled token's log-prob (nats). Raises RuntimeError when a log-prob is missing."""
    sample = output.outputs[0]
    ids = [int(t) for t in sample.token_ids]
    if sample.logprobs is None or len(sample.logprobs) < len(ids):
        raise RuntimeError(f"vLLM returned no log-prob for some tokens of request {request_id}")
    logprobs = [float(sample.logprobs[t][token].logprob) for t, token in enumerate(ids)]
    return FinishedRequest(request_id, ids, logprobs)


def external_request_id(internal_id: str) -> str:
    """The id vLLM's outputs and ``abort_request`` use for a request ``LLM.enqueue`` answered ``internal_id`` for.

    ``LLM`` numbers its requests (``"17"``) and its engine appends a random suffix to make the
    internal id (``"17-3f9a02c1"``) unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set; the
    engine's outputs carry the number.
    """
    return internal_id.split("-", 1)[0]
