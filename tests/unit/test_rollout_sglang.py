"""SGLangRollout's pure parts against a stand-in engine: requests, output layout, seeds, weights, sleep.

The stand-in answers like ``sglang.Engine`` does (``output_ids`` plus
``meta_info["output_token_logprobs"]`` as ``(logprob, token_id, text)``, control calls
answering ``(success, message)``); it decodes a fixed rule, so what is checked is the
adapter's conversion, not SGLang. The real engine is exercised by the ``gpu`` tests in
tests/integration/test_rollout_engines_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch
from verity.rollout import SamplingParams, encode_prompts
from verity.rollout.sglang_rollout import (
    SGLangOptions,
    SGLangRollout,
    collect_sglang_outputs,
    sglang_request_params,
    tensor_buckets,
)
from verity_toyworld.char_tokenizer import CharTokenizer

EOS = 2


class StandInEngine:
    """Row i's response: prompt[-1]+1, +2, ... and EOS after ``stop_after`` tokens (if it fits)."""

    def __init__(self, stop_after: int = 3) -> None:
        self.stop_after = stop_after
        self.calls: list[tuple[str, object]] = []

    def generate(self, input_ids, sampling_params, return_logprob):
        assert return_logprob is True
        self.calls.append(("generate", sampling_params))
        outputs = []
        for ids, sp in zip(input_ids, sampling_params, strict=True):
            tokens = [4 + (ids[-1] + k) % 200 for k in range(1, self.stop_after + 1)]
            if not sp["ignore_eos"] and EOS in sp["stop_token_ids"]:
                tokens.append(EOS)
            else:
                tokens += [9] * (sp["max_new_tokens"] - len(tokens))
            tokens = tokens[: sp["max_new_tokens"]]
            logprobs = [(-0.1 * (t + 1), tok, None) for t, tok in enumerate(tokens)]
            outputs.append({"output_ids": tokens, "meta_info": {"output_token_logprobs": logprobs}})
        return outputs

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        self.calls.append(("update", ([n for n, _ in named_tensors], flush_cache)))
        return (True, "ok")

    def flush_cache(self):
        self.calls.append(("flush", None))

    def release_memory_occupation(self):
        self.calls.append(("release", None))

    def resume_memory_occupation(self):
        self.calls.append(("resume", None))

    def shutdown(self):
        self.calls.append(("shutdown", None))


@pytest.fixture
def tokenizer():
    return CharTokenizer()


def rollout_with(engine, tokenizer, **options) -> SGLangRollout:
    return SGLangRollout("unused", tokenizer, max_model_len=64, engine=engine, **options)


def prompts(tokenizer, texts=("12+3=", "7-2=", "ab")):
    encoded = encode_prompts(tokenizer, list(texts))
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def test_request_params_follow_the_sampling_params():
    greedy = sglang_request_params(SamplingParams(do_sample=False, max_new_tokens=5), [2], None, 2)
    assert greedy == [greedy[0]] * 2 and greedy[0]["temperature"] == 0.0 and "sampling_seed" not in greedy[0]
    assert greedy[0]["stop_token_ids"] == [2] and greedy[0]["ignore_eos"] is False
    sampled = sglang_request_params(SamplingParams(temperature=0.7, top_p=0.9, top_k=0), [2, 5], [11, 12], 2)
    assert [r["sampling_seed"] for r in sampled] == [11, 12]
    assert sampled[0]["top_k"] == -1 and sampled[0]["top_p"] == 0.9 and sampled[0]["temperature"] == 0.7
    assert sampled[0]["stop_token_ids"] == [2, 5]
    forced = sglang_request_params(SamplingParams(top_k=4, ignore_eos=True), [2], None, 1)[0]
    assert forced["top_k"] == 4 and forced["ignore_eos"] is True
    with pytest.raises(ValueError, match="seeds: expected 3"):
        sglang_request_params(SamplingParams(), [2], [1], 3)


def test_output_conversion_pads_right_and_checks_token_ids():
    outs = [
        {
            "output_ids": [5, 6, 2],
            "meta_info": {"output_token_logprobs": [(-1.0, 5, None), (-2.0, 6, None), (-3.0, 2, None)]},
        },
        {"output_ids": [7], "meta_info": {"output_token_logprobs": [(-0.5, 7, None)]}},
    ]
    responses, mask, logprobs = collect_sglang_outputs(outs, length=4, pad_token_id=0)
    assert responses.tolist() == [[5, 6, 2, 0], [7, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert logprobs.tolist() == [[-1.0, -2.0, -3.0, 0.0], [-0.5, 0.0, 0.0, 0.0]]
    bad = [{"output_ids": [5], "meta_info": {"output_token_logprobs": [(-1.0, 6, None)]}}]
    with pytest.raises(RuntimeError, match="do not match"):
        collect_sglang_outputs(bad, 4, 0)
    with pytest.raises(ValueError, match="more than max_new_tokens=1"):
        collect_sglang_outputs(outs, 1, 0)


def test_generate_returns_the_rollout_layout(tokenizer):
    engine = StandInEngine(stop_after=3)
    rollout = rollout_with(engine, tokenizer)
    batch = Batch.from_dict(prompts(tokenizer), non_tensors={"uid": ["a", "b", "c"]})
    out = rollout.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=6, n=2))
    assert out["responses"].shape == (6, 6) and out["rollout_logprobs"].dtype == torch.float32
    assert out["group"].tolist() == [0, 0, 1, 1, 2, 2] and out.non_tensors["uid"] == list("aabbcc")
    assert out["response_mask"][0].tolist() == [1, 1, 1, 1, 0, 0]  # 3 tokens + EOS
    assert out["responses"][0, 3] == EOS and out["responses"][0, 4:].tolist() == [tokenizer.pad_token_id] * 2
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["position_ids"], (out["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    # the engine got each row's real prompt tokens, without the left padding
    sent = engine.calls[0][1]
    assert len(sent) == 6
    forced = rollout.generate(prompts(tokenizer), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert bool((forced["response_mask"] == 1).all())


def test_seeds_only_with_deterministic_inference(tokenizer):
    engine = StandInEngine()
    plain = rollout_with(engine, tokenizer)
    plain.generate(prompts(tokenizer), SamplingParams(n=2))
    assert all("sampling_seed" not in r for r in engine.calls[-1][1])

    seeded = rollout_with(engine, tokenizer, enable_deterministic_inference=True)
    params = SamplingParams(n=2)

    def seeds_after(seed):
        seeded.set_seed(seed)
        seeded.generate(prompts(tokenizer), params)
        return [r["sampling_seed"] for r in engine.calls[-1][1]]

    first, again, other = seeds_after(5), seeds_after(5), seeds_after(6)
    assert first == again and first != other
    assert len(set(first)) == len(first) == 6  # every row (also a prompt's n copies) its own seed
    seeded.generate(prompts(tokenizer), SamplingParams(do_sample=False))
    assert all("sampling_seed" not in r for r in engine.calls[-1][1])


def test_weights_go_in_buckets_then_one_flush(tokenizer):
    engine = StandInEngine()
    tensors = [(f"w{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    rollout = rollout_with(engine, tokenizer, bucket_bytes=2048)
    assert rollout.load_weights(iter(tensors)) == 5
    assert engine.calls == [
        ("update", (["w0", "w1"], False)),
        ("update", (["w2", "w3"], False)),
        ("update", (["w4"], False)),
        ("flush", None),
    ]
    assert [len(b) for b in tensor_buckets(tensors, 10)] == [1] * 5

    class Failing(StandInEngine):
        def update_weights_from_tensor(self, named_tensors, flush_cache):
            return (False, "shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        rollout_with(Failing(), tokenizer).load_weights(tensors)


def test_sleep_wake_and_close(tokenizer):
    engine = StandInEngine()
    rollout = rollout_with(engine, tokenizer)
    rollout.sleep()
    rollout.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(prompts(tokenizer))
    rollout.wake()
    rollout.wake()
    rollout.close()
    rollout.close()
    assert [name for name, _ in engine.calls] == ["release", "resume", "shutdown"]
    with pytest.raises(RuntimeError, match="closed"):
        rollout.generate(prompts(tokenizer))
    no_saver = rollout_with(StandInEngine(), tokenizer, enable_memory_saver=False, weights_cpu_backup=False)
    with pytest.raises(RuntimeError, match="enable_memory_saver"):
        no_saver.sleep()


def test_options_are_checked():
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangOptions(mem_fraction_static=1.5).validate()
    with pytest.raises(ValueError, match="weights_cpu_backup"):
        SGLangOptions(enable_memory_saver=False).validate()
    with pytest.raises(ValueError, match="bucket_bytes"):
        SGLangRollout("unused", CharTokenizer(), max_model_len=8, engine=StandInEngine(), bucket_bytes=0)
    with pytest.raises(TypeError, match="unknown option"):
        SGLangRollout("unused", CharTokenizer(), max_model_len=8, engine=StandInEngine(), mem_fraction=0.3)
