"""Grouped-query attention read in place on CPU (``verity.rollout.gqa_attention``)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from verity.rollout import HFRollout, SamplingParams, encode_prompts, gqa_attention
from verity.rollout import hf_rollout as hf_rollout_module
from verity.rollout.gqa_attention import (
    GQA_SDPA,
    GQA_SDPA_MATMUL_DECODE,
    grouped_sdpa,
    matmul_decode,
    sdpa_grouped_attention,
    takes_grouped_sdpa,
)
from verity.rollout.kv_cache import reserved_cache
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2_for

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


@pytest.fixture
def matmul_decoding(monkeypatch):
    """Reduced-precision decode calls on the two matmuls, as on a CPU without AMX tiles."""
    monkeypatch.setattr(gqa_attention, "_has_amx_tiles", lambda: False)


@pytest.mark.parametrize(
    ("dtype", "amx"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)],
    ids=["float32", "bfloat16", "float32-without-amx"],  # bf16 without AMX: the matmul decode
)
def test_prefill_and_decode_logits_equal_transformers_sdpa_to_the_bit(
    tokenizer, prompts, dtype, amx, monkeypatch
):
    monkeypatch.setattr(gqa_attention, "_has_amx_tiles", lambda: amx)
    assert not matmul_decode(dtype)
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


def _decode_inputs(dtype: torch.dtype, rows: int = 6, keys: int = 23, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, 8, 1, 64, generator=generator)
    key = torch.randn(rows, 4, keys, 64, generator=generator) * 2
    value = torch.randn(rows, 4, keys, 64, generator=generator)
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
    for row in range(rows):
        mask[row, ..., : row * 2] = False  # left padding of different lengths
    return query.to(dtype), key.to(dtype), value.to(dtype), mask


def _reference(query, key, value, mask) -> torch.Tensor:
    """float64 attention with every key/value head repeated for the query heads it serves: [B, 1, H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = (query.double() @ key.transpose(-1, -2)) / query.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ value).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmul_decode_is_exact_attention_rounded_once(tokenizer, dtype, matmul_decoding):
    module = grouped_model(tokenizer).model.layers[0].self_attn  # 4 query / 2 key-value heads
    query, key, value, mask = _decode_inputs(dtype)
    got, _ = sdpa_grouped_attention(module, query, key, value, mask)
    exact = _reference(query, key, value, mask)
    assert got.shape == exact.shape == (6, 1, 8, 64) and got.dtype == dtype
    half_ulp = torch.finfo(dtype).eps / 2 * exact.abs()
    assert bool(((got.double() - exact).abs() <= half_ulp + 1e-5).all())  # one rounding of the output
    fused = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, enable_gqa=True
    )
    assert (got.double() - exact).abs().mean() <= (fused.transpose(1, 2).double() - exact).abs().mean()
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    assert torch.equal(sdpa_grouped_attention(module, query, key, value, additive)[0], got)
    one_mask = mask[:1].expand(6, -1, -1, -1).clone()
    assert torch.equal(
        sdpa_grouped_attention(module, query, key, value, mask[:1])[0],
        sdpa_grouped_attention(module, query, key, value, one_mask)[0],
    )  # a mask for every row broadcast from one


def test_matmul_decode_in_float32_is_exact_attention(tokenizer):
    query, key, value, mask = _decode_inputs(torch.float32, keys=13)
    got = gqa_attention._grouped_matmul_decode(query, key, value, mask, None)
    assert torch.allclose(got.double(), _reference(query, key, value, mask), rtol=0, atol=1e-6)
    unmasked = gqa_attention._grouped_matmul_decode(query, key, value, None, 0.25)
    want = _reference(query * (0.25 * 8), key, value, torch.ones_like(mask))  # scale 0.25 instead of 1/8
    assert torch.allclose(unmasked.double(), want, rtol=0, atol=1e-6)


def test_only_reduced_precision_without_amx_decodes_by_matmuls(monkeypatch):
    monkeypatch.setattr(gqa_attention, "_has_amx_tiles", lambda: False)
    assert matmul_decode(torch.bfloat16) and matmul_decode(torch.float16) and not matmul_decode(torch.float32)
    monkeypatch.setattr(gqa_attention, "_has_amx_tiles", lambda: True)
    assert not matmul_decode(torch.bfloat16) and not matmul_decode(torch.float16)


def test_prefill_and_per_head_masks_stay_on_the_fused_kernel(tokenizer, matmul_decoding, monkeypatch):
    module = grouped_model(tokenizer).model.layers[0].self_attn  # 4 query / 2 key-value heads
    monkeypatch.setattr(gqa_attention, "_grouped_matmul_decode", lambda *a: pytest.fail("took the matmuls"))
    query, key, value, mask = _decode_inputs(torch.bfloat16)
    per_head = mask.expand(-1, 8, -1, -1)
    sdpa_grouped_attention(module, query, key, value, per_head)  # a mask per head
    sdpa_grouped_attention(module, query, key, value, mask, dropout=0.1)  # dropout
    prefill = torch.ones(6, 1, 23, 23, dtype=torch.bool).tril()
    sdpa_grouped_attention(module, query.expand(-1, -1, 23, -1), key, value, prefill)  # 23 queries


def test_a_bfloat16_run_records_and_takes_the_matmul_decode(tokenizer, prompts, matmul_decoding, monkeypatch):
    model = grouped_model(tokenizer, torch.bfloat16)
    calls: list[tuple[int, ...]] = []
    real = gqa_attention._grouped_matmul_decode

    def counted(query, *args):
        calls.append(tuple(query.shape))
        return real(query, *args)

    monkeypatch.setattr(gqa_attention, "_grouped_matmul_decode", counted)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True)
    rollout = HFRollout(model, tokenizer, sampling=params, seed=3)
    assert rollout.serving_attention == GQA_SDPA_MATMUL_DECODE
    out = rollout.generate(dict(prompts))
    assert out["responses"].shape == (len(PROMPTS), 5)
    assert len(calls) == 4 * 2 and all(shape[2] == 1 for shape in calls)  # 4 decode steps x 2 layers
    assert HFRollout(grouped_model(tokenizer), tokenizer).serving_attention == GQA_SDPA  # float32


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


@pytest.mark.parametrize("amx", [True, False], ids=["fused-decode", "matmul-decode"])
def test_the_benchmark_runs_and_finds_both_sides_alike(monkeypatch, capsys, amx):
    monkeypatch.setattr(gqa_attention, "_has_amx_tiles", lambda: amx)
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
    assert ("fused/grouped" in out and "matmul_decode" in out) is (not amx)
    assert hf_rollout_module.grouped_sdpa is grouped_sdpa  # the benchmark put the engine back
    assert gqa_attention._has_amx_tiles() is amx
