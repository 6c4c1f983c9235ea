"""rollout.engine=vllm|sglang: registered by name, their config sections typed and validated up front."""

from __future__ import annotations

import pytest
import torch
from verity.config import ConfigError, load_config
from verity.rollout import ROLLOUT_ENGINES, RolloutBuildContext, build_rollout_engine
from verity.rollout.options import SGLangOptions, VLLMOptions


def test_vllm_and_sglang_are_registered_rollout_engines():
    names = [name for name, _ in ROLLOUT_ENGINES.items()]
    assert {"hf", "vllm", "sglang"} <= set(names)


def test_engine_sections_are_typed_and_overridable():
    cfg = load_config(
        ["rollout.engine=vllm", "rollout.vllm.max_num_seqs=8", "rollout.vllm.kv_cache_bytes=null"]
    )
    assert isinstance(cfg.rollout.vllm, VLLMOptions) and isinstance(cfg.rollout.sglang, SGLangOptions)
    assert cfg.rollout.vllm.max_num_seqs == 8 and cfg.rollout.vllm.kv_cache_bytes is None
    assert load_config().rollout.vllm == VLLMOptions()


def test_bad_engine_options_fail_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.sleep_level: expected 1 or 2, got 3"):
        load_config(["rollout.engine=vllm", "rollout.vllm.sleep_level=3"])
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.mem_fraction_static"):
        load_config(["rollout.engine=sglang", "rollout.sglang.mem_fraction_static=2.0"])
    # a setting in the section of an engine the run does not use is rejected: it would be ignored
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.sleep_level=3: rollout\.engine=hf"):
        load_config(["rollout.engine=hf", "rollout.vllm.sleep_level=3"])
    with pytest.raises(ConfigError, match="max_num_seq"):
        load_config(["rollout.vllm.max_num_seq=8"])  # unknown key, with its closest name


def test_sglang_refuses_a_cpu_rank_before_importing_sglang():
    ctx = RolloutBuildContext(model_path="unused", tokenizer=None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA devices only"):
        build_rollout_engine("sglang", ctx)


def test_the_vllm_warnings_the_engine_causes_on_purpose_are_dropped_and_others_kept():
    import logging

    from verity.rollout.vllm_rollout import drop_expected_vllm_warnings

    class Collect(logging.Handler):  # on the loggers themselves: vLLM's may not propagate to the root
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    drop_expected_vllm_warnings()
    drop_expected_vllm_warnings()  # idempotent: one filter per logger
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    renderers = logging.getLogger("vllm.renderers.base")
    assert len(layerwise.filters) == len(renderers.filters) == 1
    seen = Collect()
    saved = [(logger, logger.disabled, logger.level) for logger in (layerwise, renderers)]
    for logger in (layerwise, renderers):
        logger.addHandler(seen)
        logger.disabled, logger.level = False, logging.NOTSET  # whatever an earlier vLLM start configured
    try:
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        renderers.warning("Using None for EOS token id because tokenizer is not initialized")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real weight: kept
    finally:
        for logger, disabled, level in saved:
            logger.removeHandler(seen)
            logger.disabled, logger.level = disabled, level
    assert seen.messages == ["QKVParallelLinear: Failed to load weights"]
