"""The interface every generation backend implements (HF transformers, vLLM, SGLang).

Input batch (``verity.batch.Batch``, or a plain dict of the same keys; output: a ``Batch``):

- ``input_ids``      [B, P] prompt token ids, **left**-padded with the pad id;
- ``attention_mask`` [B, P] 1 on real prompt tokens, 0 on padding;
- any other keys (tensors or per-row lists) pass through to the output.

Output batch (one row per sample; with ``n`` samples per prompt each input row
is repeated ``n`` times consecutively):

- ``prompts``          [B, P]   the prompt ids as given;
- ``responses``        [B, R]   response ids, right-padded with the pad id after EOS (R = ``max_new_tokens``);
- ``response_mask``    [B, R]   int64, 1 on response tokens up to and including EOS, 0 after;
- ``rollout_logprobs`` [B, R]   float32, the sampler's log-prob of each response token (0 where masked);
- ``input_ids``        [B, P+R] cat(prompts, responses);
- ``attention_mask``   [B, P+R] cat(prompt mask, response attention): the response part equals
  ``response_mask`` for single-turn engines; in multi-turn rollouts (the agent loop,
  ``verity.rollout.agent``) it is 1 on tool tokens too, which ``response_mask`` leaves out;
- ``position_ids``     [B, P+R] cumsum(attention_mask) - 1, clipped at 0.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

import torch

from verity.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from verity.rollout.requests import RequestScheduler


class RolloutEngine(abc.ABC):
    """A generation backend: sample responses, take new weights, free memory between uses."""

    #: the engine's registered name (``hf``, ``vllm``, ...): what a run records as the rollout backend
    name: str = "rollout"
    #: wrappers around the engine that named it, innermost first (e.g. ``("agent",)``); recorded by runs
    wrappers: tuple[str, ...] = ()
    #: token ids that end a response; None: the tokenizer's EOS (the agent loop stops turns on them)
    eos_token_ids: Collection[int] | None = None
    #: the id that pads responses; None: the tokenizer's
    pad_token_id: int | None = None
    #: ranks the engine splits the policy over (a tensor-parallel replica); each receives its slices
    tensor_parallel_size: int = 1
    #: with ``tensor_parallel_size > 1``: whether the weight sync sends each rank only its slices
    #: (the HF engine); False: every rank gets the full tensors and the engine slices them (vLLM)
    receives_slices: bool = True
    sampling: SamplingParams

    @abc.abstractmethod
    def generate(self, batch: Any, params: SamplingParams | None = None) -> Any:
        """Sample responses for a batch of prompts (keys and shapes in the module docstring).

        ``params`` overrides the engine's sampling parameters for this call;
        otherwise the engine's, updated by any sampling keys in the batch's meta.
        """

    @abc.abstractmethod
    def set_seed(self, seed: int) -> None:
        """Restart the engine's random stream from ``seed`` (the same seed gives the same samples)."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(parameter name, full tensor)`` pairs into the serving model in place; returns how many."""

    @property
    def serving_dtype(self) -> str | None:
        """The dtype the engine serves the policy in (``"float32"``, ``"bfloat16"``); None when unknown.

        What a run records as the rollout's dtype; read from the engine's ``dtype``
        attribute where it has one.
        """
        dtype = getattr(self, "dtype", None)
        return None if dtype is None else str(dtype).removeprefix("torch.")

    @property
    def serving_attention(self) -> str | None:
        """The attention kernel the engine decodes with (e.g. ``"sdpa"``); None when it does not say.

        What a run records as ``ran.rollout_attention``.
        """
        return None

    def sleep(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Free memory held by the engine (weights, caches) until :meth:`wake`."""

    @property
    def needs_weight_sync(self) -> bool:
        """Whether the engine released its weights while asleep and serves nothing until a weight
        sync has given it every weight again (False: :meth:`wake` brings everything back)."""
        return False

    def wake(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Bring back what :meth:`sleep` released."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the engine holds for good (processes, memory); it is not used after this."""

    def request_scheduler(self, params: SamplingParams) -> RequestScheduler:
        """A scheduler that generates request by request with ``params`` (``n`` = 1).

        The default runs one :meth:`generate` call per step over the queued requests
        (:class:`~verity.rollout.requests.BatchedCallScheduler`); engines that decode step by
        step return one that adds and retires requests between decode steps.
        """
        from verity.rollout.requests import BatchedCallScheduler

        pad = self.pad_token_id if self.pad_token_id is not None else 0
        return BatchedCallScheduler(self, params, pad)
