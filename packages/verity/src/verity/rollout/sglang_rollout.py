"""Generation with SGLang's offline engine (``sglang.Engine``), behind verity's rollout interface. GPU only.

Same batch layout as :class:`~verity.rollout.HFRollout` (``verity.rollout.base``). How
each part maps onto SGLang (checked against the source of ``sglang`` 0.5.23):

- **Prompts** go in as token-id lists (``Engine.generate(input_ids=...)``; the engine
  starts with ``skip_tokenizer_init``); with ``n`` samples each row is repeated first
  and is its own request, as in HF and vLLM.
- **Sampling**: per-request dicts with ``temperature`` (0: greedy), ``top_p``,
  ``top_k`` (-1: off), ``max_new_tokens``; the rollout's EOS ids are
  ``stop_token_ids`` and the stop token is part of the response. Unlike vLLM, SGLang's
  ``ignore_eos`` switches off every token stop, stop ids included, so it carries the
  rollout's ``ignore_eos``; SGLang also stops at the EOS ids of the model's config (the
  same ids as the tokenizer's for the models verity builds).
- **Log-probs**: ``return_logprob=True``; the sampled token's log-prob is
  ``meta_info["output_token_logprobs"][t][0]``. Without top-k/top-p SGLang reports
  ``log_softmax(logits / T)`` (greedy: ``log_softmax(logits)``), verity's convention.
- **Seeds**: SGLang honours a per-request ``sampling_seed`` only with
  ``enable_deterministic_inference``; then every sampled row gets a seed drawn from the
  rollout's generator (:meth:`SGLangRollout.set_seed`), as with vLLM. Without it the
  scheduler's RNG, seeded once with ``random_seed`` (the rollout's ``seed``; the
  actor worker offsets it by rank), decides, and a call cannot be replayed.
- **Weights**: :meth:`SGLangRollout.load_weights` sends buckets of full tensors through
  ``update_weights_from_tensor`` (``flush_cache=False``) and then flushes the radix
  cache once (``flush_cache()``), so no KV block computed with old weights is reused.
  SGLang's Qwen2 loader fills a tied ``lm_head`` from the embedding itself.
- **Memory**: :meth:`sleep` / :meth:`wake` are ``release_memory_occupation`` /
  ``resume_memory_occupation`` (needs ``enable_memory_saver``; with
  ``weights_cpu_backup`` the weights survive the sleep).
- **Processes**: SGLang runs its scheduler and detokenizer in child processes; an
  :class:`~verity.rollout.process_guard.OrphanReaper` kills them if the owner dies
  without :meth:`close`.

- **Request by request**: :meth:`SGLangRollout.request_scheduler` starts each request as its own
  ``async_generate`` coroutine on the engine's event loop (:mod:`verity.rollout.sglang_requests`).

Not run on a GPU here yet: only the pure parts (request building, output conversion,
seeds, weight bucketing, sleep/wake calls) are tested, against fakes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from verity.batch import Batch
from verity.rollout.base import RolloutEngine
from verity.rollout.batch_io import (
    build_rollout_output,
    draw_request_seeds,
    prompt_token_lists,
    read_prompt_rows,
    resolve_sampling,
    responses_from_token_lists,
)
from verity.rollout.options import SGLangOptions
from verity.rollout.process_guard import OrphanReaper, child_processes, shm_segments
from verity.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from verity.rollout.sglang_requests import SGLangRequestScheduler

logger = logging.getLogger(__name__)


def sglang_request_params(
    params: SamplingParams, eos_token_ids: Sequence[int], seeds: Sequence[int] | None, count: int
) -> list[dict[str, Any]]:
    """One SGLang sampling-params dict per request row.

    ``seeds``: per-row ``sampling_seed`` values (None: leave the engine's RNG to decide).
    Raises ValueError when ``seeds`` does not have ``count`` entries.
    """
    if seeds is not None and len(seeds) != count:
        raise ValueError(f"seeds: expected {count} (one per row), got {len(seeds)}")
    base: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "min_new_tokens": 0,
        "ignore_eos": bool(params.ignore_eos),
        "stop_token_ids": [int(i) for i in eos_token_ids],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.greedy:
        return [{**base, "temperature": 0.0} for _ in range(count)]
    base.update(
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=params.top_k if params.top_k > 0 else -1,
    )
    if seeds is None:
        return [dict(base) for _ in range(count)]
    return [{**base, "sampling_seed": int(seed)} for seed in seeds]


def collect_sglang_outputs(
    outputs: Sequence[Mapping[str, Any]], length: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(responses, response_mask, logprobs)`` [rows, length] from ``Engine.generate`` results.

    Each result carries ``output_ids`` and ``meta_info["output_token_logprobs"]``, a list of
    ``(logprob, token_id, text)``; the token ids must agree with ``output_ids``.
    """
    tokens, logprobs = [], []
    for row, out in enumerate(outputs):
        ids = [int(t) for t in out["output_ids"]]
        entries = out["meta_info"]["output_token_logprobs"]
        if [int(e[1]) for e in entries] != ids:
            raise RuntimeError(f"SGLang output row {row}: log-prob token ids do not match output_ids")
        tokens.append(ids)
        logprobs.append([float(e[0]) for e in entries])
    return responses_from_token_lists(tokens, logprobs, length, pad_token_id)


def tensor_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive lists of ``(name, tensor)`` of at most ``bucket_bytes`` each (one tensor alone if larger)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket


class SGLangRollout(RolloutEngine):
    """Batched sampling with ``sglang.Engine`` over the HF checkpoint at ``model_path`` (GPU only).

    Arguments as :class:`~verity.rollout.vllm_rollout.VLLMRollout`; the options are
    :class:`SGLangOptions` fields (``options=`` or keywords). ``engine``: an already
    started engine (or a stand-in with the same methods) instead of starting one.
    """

    name = "sglang"  # what a run records as the rollout backend

    def __init__(
        self,
        model_path: str,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        max_model_len: int,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 0,
        sampling: SamplingParams | None = None,
        pad_token_id: int | None = None,
        eos_token_ids: int | Sequence[int] | None = None,
        options: SGLangOptions | None = None,
        engine: Any | None = None,
        **option_overrides: Any,
    ) -> None:
        known = {f.name for f in fields(SGLangOptions)}
        unknown = sorted(set(option_overrides) - known)
        if unknown:
            raise TypeError(
                f"SGLangRollout: unknown option(s) {unknown}; SGLangOptions fields are {sorted(known)}"
            )
        self.options = replace(options or SGLangOptions(), **option_overrides)
        self.options.validate()
        self.model_path = str(model_path)
        self.dtype = str(dtype).removeprefix("torch.")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype!r}")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len: expected an int >= 2, got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.sampling = sampling or SamplingParams()
        if eos_token_ids is None and tokenizer is not None:
            eos_token_ids = tokenizer.eos_token_id
        if eos_token_ids is None:
            raise ValueError("eos_token_ids: not given and the tokenizer names no eos token")
        self.eos_token_ids = (
            [int(eos_token_ids)] if isinstance(eos_token_ids, int) else [int(i) for i in eos_token_ids]
        )
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id
        self.pad_token_id = int(self.eos_token_ids[0] if pad_token_id is None else pad_token_id)
        self._generator = torch.Generator().manual_seed(seed)
        self._asleep = False
        self._scheduler: SGLangRequestScheduler | None = None  # the one holding requests in the engine
        self._reaper: OrphanReaper | None = None
        self.engine = engine if engine is not None else self._start_engine(seed)

    def _start_engine(self, seed: int) -> Any:
        import sglang

        opts = self.options
        children_before, segments_before = {pid for pid, _ in child_processes()}, shm_segments()
        engine = sglang.Engine(
            model_path=self.model_path,
            dtype=self.dtype,
            context_length=self.max_model_len,
            random_seed=seed,
            skip_tokenizer_init=True,
            tp_size=opts.tensor_parallel_size,
            mem_fraction_static=opts.mem_fraction_static,
            enable_memory_saver=opts.enable_memory_saver,
            enable_weights_cpu_backup=opts.weights_cpu_backup,
            disable_cuda_graph=opts.disable_cuda_graph,
            enable_deterministic_inference=opts.enable_deterministic_inference,
            log_level=opts.log_level,
        )
        children = [(pid, created) for pid, created in child_processes() if pid not in children_before]
        self._reaper = OrphanReaper(children, shm_segments() - segments_before)
        return engine

    def close(self) -> None:
        """Shut the engine and its processes down (idempotent)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None

    def __enter__(self) -> SGLangRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _engine(self, busy_check: str | None = None) -> Any:
        """The engine; with ``busy_check`` (a method's name), refuse while a scheduler holds requests."""
        if self.engine is None:
            raise RuntimeError("SGLangRollout: the engine was closed")
        if busy_check is not None and self._scheduler is not None:
            raise RuntimeError(
                f"SGLangRollout.{busy_check}: a request scheduler holds {self._scheduler.pending()} request(s) "
                "in the engine; step it until none is pending, or close() it, first"
            )
        return self.engine

    def _request_params(self, params: SamplingParams, count: int) -> list[dict[str, Any]]:
        """``count`` request dicts; sampled rows get seeds from the stream with deterministic inference."""
        seeds = None
        if self.options.enable_deterministic_inference and not params.greedy:
            seeds = draw_request_seeds(self._generator, count)
        return sglang_request_params(params, self.eos_token_ids, seeds, count)

    def request_scheduler(self, params: SamplingParams) -> SGLangRequestScheduler:
        """Requests started and finished in SGLang's engine one by one (:mod:`verity.rollout.sglang_requests`).

        ``params``: every request's sampling parameters (``n`` = 1), as in :meth:`generate`.
        """
        from verity.rollout.sglang_requests import SGLangRequestScheduler

        return SGLangRequestScheduler(self, params)

    def _claim_scheduler(self, scheduler: SGLangRequestScheduler) -> None:
        if self._scheduler is not None and self._scheduler is not scheduler:
            raise RuntimeError(
                "SGLangRollout.request_scheduler: another scheduler still holds requests in this engine; "
                "step it until none is pending, or close() it, first"
            )
        self._scheduler = scheduler

    def _release_scheduler(self, scheduler: SGLangRequestScheduler) -> None:
        if self._scheduler is scheduler:
            self._scheduler = None

    def set_seed(self, seed: int) -> None:
        """Restart the per-request seed stream (used with ``enable_deterministic_inference``)."""
        self._generator = torch.Generator().manual_seed(seed)

    def generate(self, batch: Batch | Mapping[str, Any], params: SamplingParams | None = None) -> Batch:
        """Sample responses for left-padded prompts; keys and shapes in ``verity.rollout.base``."""
        engine = self._engine("generate")
        if self._asleep:
            raise RuntimeError("SGLangRollout.generate: the engine is asleep; call wake() first")
        params = resolve_sampling(batch, self.sampling, params)
        rows = read_prompt_rows(batch, params.n)
        prompts = prompt_token_lists(rows, params.max_new_tokens, self.max_model_len)
        requests = self._request_params(params, len(prompts))
        outputs = engine.generate(input_ids=prompts, sampling_params=requests, return_logprob=True)
        if isinstance(outputs, Mapping):
            outputs = [outputs]
        responses, response_mask, logprobs = collect_sglang_outputs(
            outputs, params.max_new_tokens, self.pad_token_id
        )
        return build_rollout_output(rows, responses, response_mask, logprobs)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send checkpoint-named full tensors bucket by bucket, then flush the prefix cache once; returns the count."""
        engine = self._engine("load_weights")
        sent = 0
        for bucket in tensor_buckets(named_tensors, self.options.bucket_bytes):
            result = engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
            _check_result("update_weights_from_tensor", result)
            sent += len(bucket)
        engine.flush_cache()
        return sent

    def sleep(self) -> None:
        """Release the engine's GPU memory (weights and KV cache) until :meth:`wake`."""
        engine = self._engine("sleep")
        if not self.options.enable_memory_saver:
            raise RuntimeError("SGLangRollout.sleep: needs enable_memory_saver=true")
        if not self._asleep:
            engine.release_memory_occupation()
            self._asleep = True

    def wake(self) -> None:
        """Take back what :meth:`sleep` released."""
        engine = self._engine()
        if self._asleep:
            engine.resume_memory_occupation()
            self._asleep = False


def _check_result(what: str, result: Any) -> None:
    """SGLang's control calls answer ``(success, message)``; raise when it failed."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {result[1] if len(result) > 1 else result}")
