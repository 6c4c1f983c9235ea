"""HFRollout: shapes, EOS handling, masks, log-prob correctness, determinism, greedy, weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.scripted_cache import ScriptedCache
from verity.batch import Batch
from verity.rollout import HFRollout, SamplingParams, encode_prompts, filter_top_k_top_p, left_pad
from verity.rollout.prompts import position_ids_from_mask
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2_for

PROMPTS = ["12+3=", "7-2=", "40+41=", "5="]


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_qwen2_for(tokenizer, seed=3).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in PROMPTS])
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def full_forward_logprobs(model, out, prompt_len, temperature):
    """Re-score the responses with one forward over prompt+response: [B, R]."""
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    scaled = logits[:, prompt_len - 1 : -1].float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, out["responses"][..., None]).squeeze(-1)


def test_encode_prompts_left_pads(tokenizer, prompts):
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    assert ids.shape == (4, 7)  # "<bos>40+41=" is the longest: 1 + 6 tokens
    assert mask[3].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert ids[3, :4].tolist() == [0] * 4 and ids[3, 4] == tokenizer.bos_token_id
    ids2, mask2 = left_pad([[5, 6], [7]], pad_token_id=0, length=3)
    assert ids2.tolist() == [[0, 5, 6], [0, 0, 7]] and mask2.tolist() == [[0, 1, 1], [0, 0, 1]]
    assert position_ids_from_mask(mask2).tolist() == [[0, 0, 1], [0, 0, 0]]


def test_shapes_masks_and_layout(model, tokenizer, prompts):
    rollout = HFRollout(model, tokenizer, sampling=SamplingParams(max_new_tokens=6), seed=0)
    out = rollout.generate(dict(prompts))
    assert out["responses"].shape == (4, 6)
    assert out["response_mask"].shape == (4, 6) and out["rollout_logprobs"].shape == (4, 6)
    assert out["input_ids"].shape == (4, 13)
    assert torch.equal(out["input_ids"], torch.cat([prompts["input_ids"], out["responses"]], 1))
    assert torch.equal(out["prompts"], prompts["input_ids"])
    assert torch.equal(out["attention_mask"], torch.cat([prompts["attention_mask"], out["response_mask"]], 1))
    expected_positions = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(out["position_ids"], expected_positions)
    assert out["rollout_logprobs"].dtype == torch.float32
    # masks are a prefix of ones; logprobs are 0 where masked and negative where not
    mask = out["response_mask"]
    assert torch.all(mask[:, 1:] <= mask[:, :-1])
    assert torch.all(out["rollout_logprobs"][mask == 0] == 0)
    assert torch.all(out["rollout_logprobs"][mask == 1] <= 0)


class ScriptedLM(torch.nn.Module):
    """A stand-in causal LM whose row r emits script[r][t] at decode step t (logit 10 vs 0)."""

    def __init__(self, script: list[list[int]], vocab: int = 100):
        super().__init__()
        self.script = script
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.prompt_len = None
        self.fed: list[torch.Tensor] = []

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True, **_):
        if past_key_values is None or past_key_values.get_seq_length() == 0:  # the prefill
            self.prompt_len = attention_mask.shape[1]
            past_key_values = ScriptedCache(self.prompt_len, input_ids.shape[0])
            self.fed = []
        else:
            fed = torch.full((len(self.script),), -1)  # -1: the row had left the decode batch
            fed[past_key_values.rows] = input_ids[:, 0]
            self.fed.append(fed)
        step = attention_mask.shape[1] - self.prompt_len
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        for row, original in enumerate(past_key_values.rows.tolist()):
            tokens = self.script[original]
            logits[row, 0, tokens[min(step, len(tokens) - 1)]] = 10.0
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)


@pytest.mark.parametrize("compact", [True, False])
def test_eos_stops_a_row_and_pads_after(tokenizer, prompts, monkeypatch, compact):
    import verity.rollout.hf_rollout as hf_rollout

    if not compact:  # finished rows ride along in the batch
        monkeypatch.setattr(hf_rollout, "COMPACT_FINISHED_FRACTION", 2.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    script = [[10, 11, eos, 12, 13], [eos, 10, 10, 10, 10], [10, 10, 10, 10, 10], [10, 11, 12, 13, eos]]
    model = ScriptedLM(script)
    greedy = SamplingParams(do_sample=False, max_new_tokens=5)
    out = HFRollout(model, tokenizer, sampling=greedy).generate(dict(prompts))
    assert out["responses"].tolist() == [
        [10, 11, eos, pad, pad],
        [eos, pad, pad, pad, pad],
        [10, 10, 10, 10, 10],
        [10, 11, 12, 13, eos],
    ]
    assert out["response_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1] * 5, [1] * 5]
    # fed[k] is response token k of each row: EOS itself, then either nothing (-1: the row has
    # left the decode batch, 1 of 4 rows finished is past COMPACT_FINISHED_FRACTION) or the pad id
    if compact:
        assert model.fed[0].tolist() == [10, -1, 10, 10]
        assert model.fed[2].tolist() == [-1, -1, 10, 12]
        assert model.fed[3].tolist() == [-1, -1, 10, 13]
    else:
        assert model.fed[2].tolist() == [eos, pad, 10, 12]
        assert model.fed[3].tolist() == [pad, pad, 10, 13]
    # the loop stops as soon as every row is finished
    short = [[eos], [10, eos], [eos], [eos]]
    model = ScriptedLM(short)
    out = HFRollout(model, tokenizer, sampling=greedy).generate(dict(prompts))
    assert len(model.fed) == 1
    assert out["response_mask"].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0],
    ]
    # ignore_eos keeps generating to max_new_tokens
    ignore = SamplingParams(do_sample=False, max_new_tokens=5, ignore_eos=True)
    out = HFRollout(ScriptedLM(script), tokenizer, sampling=ignore).generate(dict(prompts))
    assert out["responses"][0].tolist() == [10, 11, eos, 12, 13]
    assert out["response_mask"].sum() == 20
    # several stop ids (e.g. chat end-of-turn and end-of-text)
    out = HFRollout(ScriptedLM(script), tokenizer, sampling=greedy, eos_token_ids=[eos, 11]).generate(
        dict(prompts)
    )
    assert out["response_mask"][0].tolist() == [1, 1, 0, 0, 0]


def test_rollout_logprobs_match_a_full_forward(model, tokenizer, prompts):
    for params in (
        SamplingParams(temperature=1.0, max_new_tokens=6),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=6),
    ):
        out = HFRollout(model, tokenizer, sampling=params, seed=1).generate(dict(prompts))
        rescored = full_forward_logprobs(model, out, prompts["input_ids"].shape[1], params.temperature)
        mask = out["response_mask"].bool()
        torch.testing.assert_close(out["rollout_logprobs"][mask], rescored[mask], rtol=0, atol=1e-4)


def test_greedy_is_argmax_of_full_forward(model, tokenizer, prompts):
    out = HFRollout(model, tokenizer, sampling=SamplingParams(do_sample=False, max_new_tokens=6)).generate(
        dict(prompts)
    )
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    prompt_len = prompts["input_ids"].shape[1]
    argmax = logits[:, prompt_len - 1 : -1].argmax(-1)
    mask = out["response_mask"].bool()
    assert torch.equal(out["responses"][mask], argmax[mask])
    rescored = full_forward_logprobs(model, out, prompt_len, 1.0)
    torch.testing.assert_close(out["rollout_logprobs"][mask], rescored[mask], rtol=0, atol=1e-4)


def test_same_seed_same_tokens_other_seed_other_tokens(model, tokenizer, prompts):
    params = SamplingParams(temperature=1.5, max_new_tokens=8, ignore_eos=True)
    a = HFRollout(model, tokenizer, sampling=params, seed=5)
    b = HFRollout(model, tokenizer, sampling=params, seed=5)
    torch.manual_seed(0)  # the global RNG must not matter
    first = a.generate(dict(prompts))
    torch.manual_seed(99)
    assert torch.equal(first["responses"], b.generate(dict(prompts))["responses"])
    c = HFRollout(model, tokenizer, sampling=params, seed=6)
    assert not torch.equal(first["responses"], c.generate(dict(prompts))["responses"])
    a.set_seed(5)
    assert torch.equal(first["responses"], a.generate(dict(prompts))["responses"])


def test_n_samples_repeat_rows_and_set_group(model, tokenizer, prompts):
    rollout = HFRollout(model, tokenizer, sampling=SamplingParams(max_new_tokens=4, n=3), seed=0)
    batch = dict(prompts)
    batch["ground_truth"] = ["15", "5", "81", "5"]
    out = rollout.generate(batch)
    assert out["responses"].shape == (12, 4)
    assert out["group"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert out["ground_truth"] == ["15"] * 3 + ["5"] * 3 + ["81"] * 3 + ["5"] * 3
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(3, 0))


def test_batch_in_batch_out_keeps_per_row_fields_and_meta(model, tokenizer, prompts):
    batch = Batch.from_dict(
        dict(prompts), non_tensors={"ground_truth": ["15", "5", "81", "5"]}, meta={"k": 1}
    )
    out = HFRollout(model, tokenizer, sampling=SamplingParams(max_new_tokens=3)).generate(batch)
    assert isinstance(out, Batch) and len(out) == 4
    assert out["ground_truth"] == ["15", "5", "81", "5"] and out.meta["k"] == 1
    padded = batch.split(3)[-1]  # 4 rows padded to 6: the last part is 2 padding rows
    out = HFRollout(model, tokenizer, sampling=SamplingParams(max_new_tokens=3)).generate(padded)
    assert out.pad_rows == padded.pad_rows == 2
    with pytest.raises(ValueError, match="pad_rows"):
        HFRollout(model, tokenizer, sampling=SamplingParams(max_new_tokens=3, n=2)).generate(padded)


def test_meta_overrides_sampling(model, tokenizer, prompts):
    rollout = HFRollout(model, tokenizer, sampling=SamplingParams(temperature=2.0, max_new_tokens=4), seed=0)
    greedy = rollout.generate(dict(prompts), SamplingParams(do_sample=False, max_new_tokens=4))
    via_meta = rollout.generate({**prompts, "meta": {"do_sample": False}})
    assert torch.equal(greedy["responses"], via_meta["responses"])


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_top_k_top_p(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = filter_top_k_top_p(logits, top_k=-1, top_p=0.8)  # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = filter_top_k_top_p(logits, top_k=-1, top_p=0.81)
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]
    kept = filter_top_k_top_p(logits, top_k=-1, top_p=0.1)  # the top token always survives
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]


def test_draw_categorical_follows_the_probabilities_and_never_draws_a_zero():
    from verity.rollout.sampling import draw_categorical

    probs = torch.tensor([[0.5, 0.3, 0.0, 0.15, 0.05], [0.0, 0.0, 1.0, 0.0, 0.0], [0.2] * 5])
    rows = probs.repeat(40_000, 1)
    drawn = draw_categorical(rows, torch.Generator().manual_seed(3)).view(40_000, 3)
    for row in range(3):
        freq = torch.bincount(drawn[:, row], minlength=5).double() / 40_000
        # 40k draws: a frequency's standard error is at most 0.0025; 4 of them is 0.01
        torch.testing.assert_close(freq, probs[row].double(), rtol=0, atol=0.01)
        assert freq[probs[row] == 0].sum() == 0
    again = draw_categorical(rows, torch.Generator().manual_seed(3)).view(40_000, 3)
    assert torch.equal(drawn, again)  # the same generator state draws the same tokens


def test_the_ends_of_the_uniform_land_on_tokens_that_can_be_drawn():
    from verity.rollout.sampling import categorical_from_uniform

    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0], [0.0, 0.25, 0.75, 0.0]])
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    u = torch.stack([torch.tensor(0.0, dtype=torch.float64), below_one]).view(2, 1)
    assert categorical_from_uniform(probs, u).tolist() == [1, 2]
    # rows that do not quite sum to 1 (float32 softmax) are scaled by their own total
    assert categorical_from_uniform(probs * 0.999, u).tolist() == [1, 2]


def test_load_weights_copies_in_place(model, tokenizer):
    target = build_tiny_qwen2_for(tokenizer, seed=11)
    rollout = HFRollout(target, tokenizer)
    embed = target.model.embed_tokens.weight
    count = rollout.load_weights((name, t.clone()) for name, t in model.state_dict().items())
    assert count == len(model.state_dict())
    assert target.model.embed_tokens.weight is embed  # same storage, new values
    for name, tensor in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor)
    with pytest.raises(KeyError, match="no_such"):
        rollout.load_weights([("no_such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        rollout.load_weights([("model.norm.weight", torch.zeros(3))])


def test_asleep_on_cpu_the_weights_are_released_until_a_sync_fills_them(model, tokenizer, prompts):
    import copy

    rollout = HFRollout(copy.deepcopy(model), tokenizer, sampling=SamplingParams(do_sample=False, max_new_tokens=6))
    before = rollout.generate(dict(prompts))
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    rollout.sleep()
    assert rollout.needs_weight_sync
    assert sum(p.numel() for p in rollout.model.parameters()) == 0  # no storage held
    assert all(b.numel() > 0 for b in rollout.model.buffers())  # rotary frequencies kept
    rollout.wake()
    with pytest.raises(RuntimeError, match="a weight sync must come before the next generate"):
        rollout.generate(dict(prompts))
    rollout.load_weights([("model.norm.weight", weights["model.norm.weight"])])
    assert rollout.needs_weight_sync  # one weight is not all of them
    rollout.load_weights(weights.items())
    assert not rollout.needs_weight_sync
    after = rollout.generate(dict(prompts))
    assert torch.equal(after["responses"], before["responses"])
    torch.testing.assert_close(after["rollout_logprobs"], before["rollout_logprobs"], rtol=0, atol=0)


def test_bad_inputs_raise(model, tokenizer, prompts):
    rollout = HFRollout(model, tokenizer)
    with pytest.raises(KeyError, match="attention_mask"):
        rollout.generate({"input_ids": prompts["input_ids"]})
    right_padded = {"input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="left-padded"):
        rollout.generate(right_padded)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_repeated_prompts_prefill_once_and_sample_as_if_each_had_its_own(
    model, tokenizer, prompts, monkeypatch
):
    """n samples per prompt: one prefill row per prompt, the same tokens and log-probs as n prefills."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=4, ignore_eos=True)
    prefill_rows: list[int] = []
    forward = model.forward

    def counting_forward(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or cache.get_seq_length() == 0:  # the prefill
            prefill_rows.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting_forward)
    shared = HFRollout(model, tokenizer, sampling=params, seed=2).generate(dict(prompts))
    assert prefill_rows == [len(PROMPTS)]  # 4 prompts prefilled, not 16 rows

    original = HFRollout._prefill
    monkeypatch.setattr(HFRollout, "_prefill", lambda self, *a, shared=True: original(self, *a, shared=False))
    separate = HFRollout(model, tokenizer, sampling=params, seed=2).generate(dict(prompts))
    assert prefill_rows[-1] == 4 * len(PROMPTS)
    assert torch.equal(shared["responses"], separate["responses"])
    torch.testing.assert_close(shared["rollout_logprobs"], separate["rollout_logprobs"], rtol=0, atol=1e-5)
    rescored = full_forward_logprobs(model, shared, prompts["input_ids"].shape[1], 1.0)
    torch.testing.assert_close(shared["rollout_logprobs"], rescored, rtol=0, atol=1e-4)


def test_the_reserved_kv_cache_decodes_what_a_growing_one_does(model, tokenizer, prompts, monkeypatch):
    """Keys/values appended in place (rollout.kv_cache): the same tokens and log-probs as torch.cat's cache."""
    import verity.rollout.hf_rollout as hf_rollout
    from transformers import DynamicCache
    from verity.rollout.kv_cache import ReservedLayer, reserved_cache

    params = SamplingParams(temperature=1.0, max_new_tokens=7, n=3, ignore_eos=True)
    reserved = HFRollout(model, tokenizer, sampling=params, seed=4).generate(dict(prompts))
    monkeypatch.setattr(hf_rollout, "reserved_cache", lambda capacity: DynamicCache())
    growing = HFRollout(model, tokenizer, sampling=params, seed=4).generate(dict(prompts))
    assert torch.equal(reserved["responses"], growing["responses"])
    torch.testing.assert_close(reserved["rollout_logprobs"], growing["rollout_logprobs"], rtol=0, atol=1e-6)

    # a buffer that runs out of room grows; reorder and crop keep the filled positions right
    layer = ReservedLayer(capacity=2)
    keys = torch.randn(2, 1, 5, 3)
    for t in range(5):
        out_keys, _ = layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
    assert torch.equal(out_keys, keys) and layer.get_seq_length() == 5
    layer.reorder_cache(torch.tensor([1, 1, 0]))
    assert torch.equal(layer.keys, keys[[1, 1, 0]])
    layer.crop(-2)
    assert torch.equal(layer.keys, keys[[1, 1, 0], :, :3]) and layer.get_seq_length() == 3
    assert reserved_cache(8).get_seq_length() == 0


def test_finished_rows_leaving_the_batch_changes_no_token(tokenizer, monkeypatch):
    """Greedy decoding with and without dropping finished rows: the same responses and log-probs."""
    import verity.rollout.hf_rollout as hf_rollout
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    model = build_tiny_qwen2_for(tokenizer, seed=7).eval()
    eos = tokenizer.eos_token_id

    def eos_where_the_state_says(module, inputs, logits):  # rows finish at different steps (row-wise only)
        logits[..., eos] += 8.0 * torch.tanh(4.0 * inputs[0][..., 0])
        return logits

    model.lm_head.register_forward_hook(eos_where_the_state_says)
    many = [[{"role": "user", "content": f"{a}+{b}="}] for a in range(1, 9) for b in (3, 45)]
    encoded = encode_prompts(tokenizer, many)
    prompts = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    greedy = SamplingParams(do_sample=False, max_new_tokens=12)
    compacted = HFRollout(model, tokenizer, sampling=greedy).generate(dict(prompts))
    lengths = compacted["response_mask"].sum(-1)
    assert int(lengths.min()) >= 1 and len(set(lengths.tolist())) >= 3  # rows finish at different steps
    monkeypatch.setattr(hf_rollout, "COMPACT_FINISHED_FRACTION", 2.0)
    riding = HFRollout(model, tokenizer, sampling=greedy).generate(dict(prompts))
    assert torch.equal(compacted["responses"], riding["responses"])
    assert torch.equal(compacted["response_mask"], riding["response_mask"])
    # the same tokens; the log-probs to float32 rounding: a smaller decode batch may take another
    # matmul blocking (on an AVX-512 AMD EPYC one value of 192 differed by 1.1e-5, 6.6e-6 relative)
    torch.testing.assert_close(
        compacted["rollout_logprobs"], riding["rollout_logprobs"], rtol=1e-5, atol=1e-5
    )
