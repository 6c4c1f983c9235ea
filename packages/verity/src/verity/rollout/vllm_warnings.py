"""vLLM log records that :class:`~verity.rollout.vllm_rollout.VLLMRollout` causes on purpose, filtered out.

vLLM runs without a tokenizer here and reloads weights only at a weight sync; the records
those choices produce read like errors in a run's output and say nothing wrong.
"""

from __future__ import annotations

import logging

__all__ = ["EXPECTED_VLLM_WARNINGS", "drop_expected_vllm_warnings", "quiet_tokenizer_free_warmup"]


# vLLM warnings that this engine causes on purpose, with why each is expected
EXPECTED_VLLM_WARNINGS = {
    # vLLM runs without a tokenizer here; the EOS and pad ids come from the trainer's tokenizer
    "vllm.renderers.base": (
        "Using None for EOS token id because tokenizer is not initialized",
        "Using None for BOS token id because tokenizer is not initialized",
    ),
    # a weight sync reloads weights only: the rotary cos/sin cache is not one, and vLLM keeps its own
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
}


class _DropExpected(logging.Filter):
    def __init__(self, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


def drop_expected_vllm_warnings() -> None:
    """Filter :data:`EXPECTED_VLLM_WARNINGS` out of vLLM's loggers in this process (once; idempotent).

    They read like errors in a run's output (``RotaryEmbedding: Failed to load weights
    [repeated 5x across cluster]`` at every weight sync) and say nothing wrong.
    """
    for name, messages in EXPECTED_VLLM_WARNINGS.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in target.filters):
            target.addFilter(_DropExpected(messages))


class quiet_tokenizer_free_warmup:
    """Drop vLLM's "Chat template warmup failed" record: it starts without a tokenizer on purpose."""

    def __enter__(self) -> None:
        self.logger = logging.getLogger("vllm.renderers.base")
        self.filter = _DropChatWarmup()
        self.logger.addFilter(self.filter)

    def __exit__(self, *exc: object) -> None:
        self.logger.removeFilter(self.filter)


class _DropChatWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Chat template warmup failed" not in record.getMessage()
