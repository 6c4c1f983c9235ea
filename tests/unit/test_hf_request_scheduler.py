"""The HF engine's request scheduler against HFRollout.generate on each request alone.

The tiny Qwen2 models are built with a wider initialiser than the default (``INIT``) so that
consecutive tokens differ and the next-token logits lie apart (greedy decoding does not hinge
on the last bits of another batch shape); a ninth of the vocabulary ends a response, so
requests stop at different steps. Log-probs are compared within 1e-5: ``generate`` itself
differs from ``generate`` on one row alone by a few 1e-6 at these shapes (float32 rounding of
another batch shape), the scheduler by as much.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import tiny_qwen2_config
from verity.rollout import HFRollout, SamplingParams
from verity.rollout.hf_requests import HFRequestScheduler
from verity.rollout.kv_cache import reserved_cache, stack_left_padded
from verity.rollout.prompts import left_pad
from verity.rollout.requests import GenerationRequest

INIT = 0.2
EOS = list(range(3, 100, 9))
PAD = 0
GREEDY = SamplingParams(do_sample=False)
SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.95)
CONTEXTS = [
    [11, 12, 13, 14, 15],
    [21, 22, 23],
    [31],
    [41, 42, 43, 44, 45, 46, 47, 48, 49],
    [51, 52],
    [61, 62, 63, 64],
]


def make_model(seed: int = 0, kv_heads: int = 2, attention: str = "sdpa"):
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(initializer_range=INIT)
    config.num_key_value_heads, config.max_position_embeddings = kv_heads, 128
    config._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return make_model()  # 4 query heads over 2 key/value heads: grouped-query attention


def engine_of(model, seed: int = 0) -> HFRollout:
    return HFRollout(model, eos_token_ids=EOS, pad_token_id=PAD, seed=seed)


def alone(model, context, max_new_tokens: int, params: SamplingParams = GREEDY):
    """``generate`` on one context: (token ids up to and including a stop token, their log-probs)."""
    ids, mask = left_pad([context], PAD)
    params = SamplingParams(**{**params.to_dict(), "max_new_tokens": max_new_tokens})
    out = engine_of(model).generate({"input_ids": ids, "attention_mask": mask}, params)
    length = int(out["response_mask"][0].sum())
    return out["responses"][0, :length].tolist(), out["rollout_logprobs"][0, :length]


def drive(scheduler, arrivals: dict[int, list[GenerationRequest]], steps: int = 1000) -> dict:
    """Add ``arrivals[s]`` before step ``s``; step until nothing is held. Returns request id ->
    (FinishedRequest, the step that returned it)."""
    done: dict = {}
    for step in range(steps):
        for request in arrivals.get(step, []):
            scheduler.add(request)
        if not scheduler.pending() and step > max(arrivals, default=0):
            break
        for finished in scheduler.step():
            assert finished.request_id not in done
            done[finished.request_id] = (finished, step)
    return done


def assert_matches_generate(model, done: dict, lengths: dict[int, int]) -> None:
    for request_id, (finished, _) in done.items():
        tokens, logprobs = alone(model, CONTEXTS[request_id], lengths[request_id])
        assert finished.token_ids == tokens, f"request {request_id}"
        torch.testing.assert_close(torch.tensor(finished.logprobs), logprobs, atol=1e-5, rtol=0)


def test_stacking_cache_rows_right_aligns_them_over_zeros():
    first, second = reserved_cache(8), reserved_cache(4)
    a = torch.arange(3 * 2 * 5 * 4, dtype=torch.float32).reshape(3, 2, 5, 4) + 1
    b = -torch.arange(1 * 2 * 2 * 4, dtype=torch.float32).reshape(1, 2, 2, 4) - 1
    first.update(a, a * 10, 0)
    second.update(b, b * 10, 0)
    stacked = stack_left_padded([(first, torch.tensor([2, 0]), 1), (second, None, 0)], capacity=9)
    layer = stacked.layers[0]
    assert stacked.get_seq_length() == 4 and layer._key_buffer.shape == (3, 2, 9, 4)
    assert torch.equal(layer.keys[:2], a[[2, 0], :, 1:])
    assert torch.equal(layer.values[:2], a[[2, 0], :, 1:] * 10)
    assert torch.equal(layer.keys[2, :, 2:], b[0]) and torch.equal(layer.keys[2, :, :2], torch.zeros(2, 2, 4))
    stacked.update(
        b[:, :, :1].expand(3, -1, -1, -1), b[:, :, :1].expand(3, -1, -1, -1), 0
    )  # appends in place
    assert stacked.get_seq_length() == 5 and stacked.layers[0]._key_buffer.shape[-2] == 9


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["grouped-query", "one-kv-head-per-query"])
def test_requests_added_together_decode_what_generate_does_alone(kv_heads):
    model = make_model(kv_heads=kv_heads)
    lengths = {i: 12 for i in range(len(CONTEXTS))}
    scheduler = engine_of(model).request_scheduler(GREEDY)
    assert isinstance(scheduler, HFRequestScheduler)
    done = drive(scheduler, {0: [GenerationRequest(i, c, 12) for i, c in enumerate(CONTEXTS)]})
    assert sorted(done) == list(range(len(CONTEXTS)))
    assert_matches_generate(model, done, lengths)
    stopped = [f for f, _ in done.values() if f.token_ids[-1] in EOS]
    assert stopped and len(stopped) < len(done)  # some stop on a stop token, some at max_new_tokens
    assert all(len(f.token_ids) == 12 for f, _ in done.values() if f not in stopped)
    assert all(t not in EOS for f, _ in done.values() for t in f.token_ids[:-1])


def test_requests_added_mid_decode_decode_what_generate_does_alone(model):
    lengths = {0: 16, 1: 9, 2: 14, 3: 16, 4: 1, 5: 7}
    arrivals = {
        0: [GenerationRequest(0, CONTEXTS[0], 16)],
        2: [GenerationRequest(1, CONTEXTS[1], 9), GenerationRequest(3, CONTEXTS[3], 16)],
        5: [GenerationRequest(2, CONTEXTS[2], 14)],
        6: [GenerationRequest(4, CONTEXTS[4], 1), GenerationRequest(5, CONTEXTS[5], 7)],
    }
    scheduler = engine_of(model).request_scheduler(GREEDY)
    done = drive(scheduler, arrivals)
    assert sorted(done) == list(range(6))
    assert_matches_generate(model, done, lengths)
    assert done[4][1] == 6 and done[4][0].token_ids == alone(model, CONTEXTS[4], 1)[0]  # max_new_tokens=1
    assert scheduler.rebuilds >= 3  # each arrival after the first joined a running batch


def test_max_new_tokens_one_finishes_in_the_step_that_admits_it(model):
    scheduler = engine_of(model).request_scheduler(GREEDY)
    scheduler.add(GenerationRequest(7, CONTEXTS[1], 1))
    assert scheduler.pending() == 1
    (finished,) = scheduler.step()
    assert finished.request_id == 7 and len(finished.token_ids) == 1 and len(finished.logprobs) == 1
    assert scheduler.pending() == 0 and scheduler.step() == []


def test_empty_scheduler_steps_return_nothing(model):
    scheduler = engine_of(model).request_scheduler(GREEDY)
    assert scheduler.pending() == 0 and scheduler.step() == [] and scheduler.step() == []


def test_many_retire_in_one_step_and_the_rest_decode_on_unchanged(model):
    ignore = SamplingParams(do_sample=False, ignore_eos=True)
    scheduler = engine_of(model).request_scheduler(ignore)
    for i in range(5):
        scheduler.add(GenerationRequest(i, CONTEXTS[i], 3))
    scheduler.add(GenerationRequest(5, CONTEXTS[3], 10))
    returned = [sorted(f.request_id for f in scheduler.step()) for _ in range(10)]
    assert returned[:3] == [[], [], [0, 1, 2, 3, 4]] and returned[9] == [5]
    assert scheduler.pending() == 0 and scheduler.step() == []


def test_stop_tokens_end_a_request_unless_ignore_eos(model):
    scheduler = engine_of(model).request_scheduler(GREEDY)
    done = drive(scheduler, {0: [GenerationRequest(i, c, 24) for i, c in enumerate(CONTEXTS)]})
    stopped = {i for i, (f, _) in done.items() if len(f.token_ids) < 24}
    assert stopped and all(done[i][0].token_ids[-1] in EOS for i in stopped)
    ignoring = engine_of(model).request_scheduler(SamplingParams(do_sample=False, ignore_eos=True))
    done = drive(ignoring, {0: [GenerationRequest(i, CONTEXTS[i], 24) for i in stopped]})
    assert all(len(f.token_ids) == 24 for f, _ in done.values())


def test_retired_rows_and_unneeded_columns_leave_the_cache(model):
    """A long context retires early; the rows left need fewer columns, and the batch sheds them."""
    ignore = SamplingParams(do_sample=False, ignore_eos=True)
    scheduler = engine_of(model).request_scheduler(ignore)
    scheduler.add(GenerationRequest(0, list(range(10, 50)), 2))  # 40 tokens, 2 new
    for i in (1, 2):
        scheduler.add(GenerationRequest(i, CONTEXTS[i], 6))
    scheduler.step()
    assert scheduler._mask.shape == (3, 41)  # the contexts' 40 columns and one decoded token
    scheduler.step()  # request 0 retires; its row and the 37 columns only it used leave
    assert scheduler._mask.shape[0] == 2 and scheduler._mask.shape[1] < 10
    assert scheduler._cache.get_seq_length() == scheduler._mask.shape[1]
    assert torch.all(scheduler._mask[:, 0] == 1) | torch.all(scheduler._mask.sum(0) > 0)
    done = drive(scheduler, {})
    for i in (1, 2):
        assert done[i][0].token_ids == alone(model, CONTEXTS[i], 6, ignore)[0]


def test_repeated_contexts_sample_as_if_each_were_alone(model):
    scheduler = engine_of(model).request_scheduler(GREEDY)
    done = drive(scheduler, {0: [GenerationRequest(i, CONTEXTS[0], 8) for i in range(3)]})
    want = alone(model, CONTEXTS[0], 8)[0]
    assert [done[i][0].token_ids for i in range(3)] == [want] * 3


def sampled_run(model, seed: int) -> dict:
    scheduler = engine_of(model, seed=seed).request_scheduler(SAMPLED)
    arrivals = {
        0: [GenerationRequest(i, CONTEXTS[i], 10) for i in range(3)],
        3: [GenerationRequest(i, CONTEXTS[i], 10) for i in range(3, 6)],
    }
    return {i: (f.token_ids, f.logprobs) for i, (f, _) in drive(scheduler, arrivals).items()}


def test_a_sampled_run_is_reproducible_for_a_seed(model):
    first, again, other = sampled_run(model, 3), sampled_run(model, 3), sampled_run(model, 4)
    assert first == again
    assert {i: t for i, (t, _) in first.items()} != {i: t for i, (t, _) in other.items()}


def test_sampled_logprobs_are_those_of_a_full_forward(model):
    """Each token's log-prob is log_softmax(logits / T) at its position in context + response."""
    for request_id, (tokens, logprobs) in sampled_run(model, 3).items():
        sequence = torch.tensor([CONTEXTS[request_id] + tokens])
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0, len(CONTEXTS[request_id]) - 1 : -1].float()
        want = torch.log_softmax(logits / SAMPLED.temperature, -1).gather(-1, torch.tensor(tokens)[:, None])
        # another computation (one forward over the whole sequence): float32 rounding of its own
        torch.testing.assert_close(torch.tensor(logprobs), want.squeeze(-1), atol=1e-4, rtol=0)


def test_eager_attention_decodes_the_same(model):
    eager = make_model(attention="eager")
    scheduler = engine_of(eager).request_scheduler(GREEDY)
    done = drive(
        scheduler, {0: [GenerationRequest(0, CONTEXTS[0], 6)], 2: [GenerationRequest(3, CONTEXTS[3], 6)]}
    )
    assert_matches_generate(eager, done, {0: 6, 3: 6})


def test_bad_requests_and_released_weights_raise(model):
    scheduler = engine_of(model).request_scheduler(GREEDY)
    with pytest.raises(ValueError, match="non-empty context"):
        scheduler.add(GenerationRequest(0, [], 4))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        scheduler.add(GenerationRequest(0, [1, 2], 0))
    asleep_model = make_model(seed=1)
    asleep = engine_of(asleep_model)
    asleep.sleep()
    stalled = asleep.request_scheduler(GREEDY)
    stalled.add(GenerationRequest(0, [1, 2], 4))
    with pytest.raises(RuntimeError, match="weight sync must come before the next step"):
        stalled.step()


def test_close_drops_everything(model):
    scheduler = engine_of(model).request_scheduler(GREEDY)
    scheduler.add(GenerationRequest(0, CONTEXTS[0], 8))
    scheduler.step()
    scheduler.add(GenerationRequest(1, CONTEXTS[1], 8))
    scheduler.close()
    assert scheduler.pending() == 0 and scheduler.step() == [] and scheduler._cache is None


def test_the_model_is_switched_while_a_batch_is_held_and_put_back_after():
    from verity.rollout.gqa_attention import GQA_SDPA

    model = make_model(seed=2).train()
    scheduler = engine_of(model).request_scheduler(GREEDY)
    scheduler.add(GenerationRequest(0, CONTEXTS[0], 3))
    scheduler.step()
    assert not model.training and model.config._attn_implementation == GQA_SDPA
    drive(scheduler, {})
    assert model.training and model.config._attn_implementation == "sdpa"
    scheduler.add(GenerationRequest(1, CONTEXTS[1], 3))
    scheduler.step()
    scheduler.close()  # mid-batch
    assert model.training and model.config._attn_implementation == "sdpa"


def test_the_benchmark_runs_and_prints_both_sides(monkeypatch, capsys):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "packages/verity/benchmarks/bench_hf_request_scheduler.py"
    argv = [str(script), "--requests", "6", "--hidden", "32", "--layers", "1", "--plain-tokens", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--repeats", "1", "--gap-ms", "1"])
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "scheduler / waves: throughput" in printed and "overhead" in printed and "merges" in printed


def test_padding_columns_alone_trigger_a_rebuild_and_tokens_do_not_change(model):
    """Nine rows, one with a long context retiring: a ninth of the rows is dead (under the
    compaction share) but most columns are padding for every live row, so they leave."""
    ignore = SamplingParams(do_sample=False, ignore_eos=True)
    scheduler = engine_of(model).request_scheduler(ignore)
    scheduler.add(GenerationRequest(99, list(range(10, 50)), 2))
    for i in range(8):
        scheduler.add(GenerationRequest(i, CONTEXTS[i % 6], 6))
    scheduler.step()
    scheduler.step()  # request 99 retires; 1 of 9 rows dead, 31+ of 42 columns padding for the rest
    assert scheduler._mask.shape[0] == 8 and scheduler._mask.shape[1] <= 9 + 2
    done = drive(scheduler, {})
    for i in range(8):
        assert done[i][0].token_ids == alone(model, CONTEXTS[i % 6], 6, ignore)[0]


def test_the_batch_stays_the_size_of_what_is_live(model):
    """One request arriving per step, each decoding 5 tokens: rows and columns stay bounded."""
    ignore = SamplingParams(do_sample=False, ignore_eos=True)
    scheduler = engine_of(model).request_scheduler(ignore)
    widest, most_rows = 0, 0
    for step in range(40):
        if step < 30:
            scheduler.add(GenerationRequest(step, CONTEXTS[step % 6], 5))
        scheduler.step()
        if scheduler._mask is not None:
            widest = max(widest, scheduler._mask.shape[1])
            most_rows = max(most_rows, scheduler._mask.shape[0])
    assert scheduler.pending() == 0
    assert most_rows <= 6 and widest <= max(map(len, CONTEXTS)) + 5 + 2
