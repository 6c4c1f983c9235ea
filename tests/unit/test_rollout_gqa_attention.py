"""Grouped-query attention read in place on CPU (``verity.rollout.gqa_attention``)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from verity.data.char_tokenizer import CharTokenizer
from verity.data.tiny_model import build_tiny_qwen2_for
from verity.rollout import HFRollout, SamplingParams, encode_prompts
from verity.rollout import hf_rollout as hf_rollout_module
from verity.rollout.gqa_attention import GQA_SDPA, grouped_sdpa, sdpa_grouped_attention, takes_grouped_sdpa
from verity.rollout.kv_cache import reserved_cache

PROMPTS = ["12+3=", "7-2=", "40+41=", "5=", "123-45="]


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


def grouped_model(tokenizer, dtype=torch.float32, **sizes):
    sizes = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, **sizes}
    return build_tiny_qwen2_for(tokenizer, seed=5, **sizes).to(dtype).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in PROMPTS])
    assert not bool(encoded["attention_mask"].all())  # left padding: the calls carry a mask
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def test_only_cpu_sdpa_models_with_grouped_heads_are_switched(tokenizer):
    assert takes_grouped_sdpa(grouped_model(tokenizer))
    assert not takes_grouped_sdpa(grouped_model(tokenizer, kv_heads=4))  # one key/value head per query head
    eager = grouped_model(tokenizer)
    eager.set_attn_implementation("eager")
    assert not takes_grouped_sdpa(eager)
    with grouped_sdpa(grouped_model(tokenizer, kv_heads=4)) as switched:
        assert switched is False
    assert not takes_grouped_sdpa(grouped_model(tokenizer).to("meta"))  # off the CPU: transformers' sdpa


def test_the_block_switches_and_always_switches_back(tokenizer):
    model = grouped_model(tokenizer)
    with grouped_sdpa(model) as switched:
        assert switched and model.config._attn_implementation == GQA_SDPA
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"), grouped_sdpa(model):
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_decode_logits_equal_transformers_sdpa_to_the_bit(tokenizer, prompts, dtype):
    model = grouped_model(tokenizer, dtype)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    step = torch.tensor([[7]] * len(ids))
    position = (mask.sum(-1, keepdim=True) - 1) + 1
    decode_mask = torch.cat([mask, torch.ones_like(step)], dim=1)

    def run() -> tuple[torch.Tensor, ...]:
        cache = reserved_cache(ids.shape[1] + 4)
        with torch.no_grad():
            masked = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            decoded = model(
                input_ids=step, attention_mask=decode_mask, position_ids=position, past_key_values=cache
            ).logits
            unmasked = model(input_ids=ids[1:2, -3:]).logits  # no mask: the causal flag
        return masked, decoded, unmasked

    want = run()
    with grouped_sdpa(model):
        got = run()
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_a_causal_call_with_more_keys_than_queries_and_no_mask_is_refused(tokenizer):
    module = grouped_model(tokenizer).model.layers[0].self_attn
    query, key = torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 5, 16)
    with pytest.raises(ValueError, match="5 keys for 2 queries"):
        sdpa_grouped_attention(module, query, key, key, None)


def test_generate_decodes_with_grouped_attention_and_samples_the_same_tokens(tokenizer, prompts, monkeypatch):
    model = grouped_model(tokenizer)
    seen: list[str] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation)
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    rollout = HFRollout(model, tokenizer, sampling=params, seed=11)
    assert rollout.serving_attention == GQA_SDPA
    got = rollout.generate(dict(prompts))
    assert seen and set(seen) == {GQA_SDPA}  # prefill and every decode step
    assert model.config._attn_implementation == "sdpa"

    monkeypatch.setattr(hf_rollout_module, "grouped_sdpa", lambda model: nullcontext(False))
    seen.clear()
    want = HFRollout(model, tokenizer, sampling=params, seed=11).generate(dict(prompts))
    assert set(seen) == {"sdpa"}
    for key in ("responses", "response_mask", "rollout_logprobs"):
        assert torch.equal(got[key], want[key]), key


def test_a_model_without_grouped_heads_reports_its_own_attention(tokenizer):
    rollout = HFRollout(grouped_model(tokenizer, kv_heads=4), tokenizer)
    assert rollout.serving_attention == "sdpa"


def test_the_benchmark_runs_and_finds_both_sides_alike(monkeypatch, capsys):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "packages/verity/benchmarks/bench_gqa_attention.py"
    argv = [
        str(script),
        "--hidden",
        "64",
        "--layers",
        "1",
        "--rows",
        "16",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "ratio" in out and "same tokens and log-probs: True" in out
    assert hf_rollout_module.grouped_sdpa is grouped_sdpa  # the benchmark put the engine back
