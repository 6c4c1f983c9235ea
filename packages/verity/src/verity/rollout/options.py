"""The options of the vLLM and SGLang rollout engines: config sections ``rollout.vllm`` and ``rollout.sglang``.

Plain dataclasses (no engine is imported here), so the run config can hold them and
validate them before any worker starts; the engine the run uses (``rollout.engine``)
reads its own section, and a setting changed in the other one is rejected before the run
(:mod:`verity.config.idle_settings`). ``validate()`` raises ValueError naming the field;
the engines call it too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_SGLANG_BUCKET_BYTES", "SGLangOptions", "VLLMOptions"]

DEFAULT_SGLANG_BUCKET_BYTES = 512 * 1024**2


@dataclass
class VLLMOptions:
    """The vLLM engine's options (config section ``rollout.vllm``).

    ``kv_cache_bytes``: KV-cache size in bytes (None: vLLM sizes it from
    ``gpu_memory_utilization``, the fraction of device memory it may take; on CPU
    that fraction is of host memory and fails on a shared machine, so give bytes).
    ``tensor_parallel_size``: GPUs one engine spans (> 1 needs ``in_process=False``).
    ``in_process``: run the engine inside the calling process (None: when
    ``tensor_parallel_size == 1``). ``enforce_eager``: no torch.compile / CUDA graphs
    (fast start-up). ``enable_prefix_caching``: reuse KV blocks of shared prompt
    prefixes. ``max_num_seqs``: sequences per engine step. ``enable_sleep_mode``:
    sleep/wake free device memory (None: on GPUs; vLLM refuses it on CPU).
    ``sleep_level``: 1 keeps weights in host memory, 2 drops them (the next weight
    sync must send them all). ``cache_dir``: ``VLLM_CACHE_ROOT`` during start-up
    (None: vLLM's default under the home folder).
    """

    kv_cache_bytes: int | None = 256 * 1024**2  # KV-cache bytes; null: sized from gpu_memory_utilization
    gpu_memory_utilization: float = (
        0.5  # fraction of device memory (on CPU: host memory) when kv_cache_bytes is null
    )
    tensor_parallel_size: int = 1  # GPUs one engine spans (> 1 runs worker processes)
    in_process: bool | None = None  # engine inside the caller's process; null: when tensor_parallel_size == 1
    enforce_eager: bool = True  # no torch.compile / CUDA graphs: fast start-up
    enable_prefix_caching: bool = (
        True  # reuse KV blocks of shared prompt prefixes (reset after each weight sync)
    )
    max_num_seqs: int = 256  # sequences per engine step
    enable_sleep_mode: bool | None = None  # sleep()/wake() free device memory; null: on GPUs (none on CPU)
    sleep_level: int = 1  # 1: weights kept in host memory; 2: dropped (the next sync resends them)
    cache_dir: str | None = None  # VLLM_CACHE_ROOT during start-up; null: vLLM's default

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        if self.kv_cache_bytes is not None and (
            not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes <= 0
        ):
            raise ValueError(f"kv_cache_bytes: expected a positive int or None, got {self.kv_cache_bytes!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: expected a number in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: expected an int >= 1, got {self.tensor_parallel_size!r}")
        if self.in_process and self.tensor_parallel_size > 1:
            raise ValueError(
                f"in_process: vLLM runs tensor_parallel_size={self.tensor_parallel_size} in worker processes; "
                "set in_process to false or null"
            )
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected an int >= 1, got {self.max_num_seqs!r}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level: expected 1 or 2, got {self.sleep_level!r}")

    @property
    def runs_in_process(self) -> bool:
        """Whether the engine runs inside the owner's process."""
        return self.tensor_parallel_size == 1 if self.in_process is None else self.in_process


@dataclass
class SGLangOptions:
    """The SGLang engine's options (config section ``rollout.sglang``).

    ``mem_fraction_static``: fraction of GPU memory for weights + KV cache.
    ``tensor_parallel_size``: GPUs one engine spans. ``enable_memory_saver``: lets
    sleep/wake release and resume GPU memory. ``weights_cpu_backup``: keep a host copy of
    the weights across a sleep (else they must be re-sent after wake). ``disable_cuda_graph``:
    faster start-up, slower decoding. ``enable_deterministic_inference``: honour the
    per-request seeds (slower kernels). ``bucket_bytes``: bytes per ``update_weights_from_tensor`` call.
    ``log_level``: SGLang's logging level.
    """

    mem_fraction_static: float = 0.5  # fraction of GPU memory for weights + KV cache
    tensor_parallel_size: int = 1  # GPUs one engine spans
    enable_memory_saver: bool = True  # lets sleep()/wake() release and resume GPU memory
    weights_cpu_backup: bool = True  # keep a host copy of the weights across a sleep
    disable_cuda_graph: bool = False  # faster start-up, slower decoding
    enable_deterministic_inference: bool = False  # honour per-request seeds (slower kernels)
    bucket_bytes: int = DEFAULT_SGLANG_BUCKET_BYTES  # bytes per update_weights_from_tensor call
    log_level: str = "error"  # SGLang's logging level

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static: expected a number in (0, 1), got {self.mem_fraction_static!r}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: expected an int >= 1, got {self.tensor_parallel_size!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: expected a positive int, got {self.bucket_bytes!r}")
        if self.weights_cpu_backup and not self.enable_memory_saver:
            raise ValueError(
                "weights_cpu_backup: needs enable_memory_saver (it backs up what a sleep releases)"
            )
