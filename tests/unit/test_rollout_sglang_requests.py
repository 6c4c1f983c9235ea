"""SGLangRollout's request scheduler against a stand-in async engine: requests, outputs, order, refusals.

The stand-in answers ``async_generate`` like ``sglang.Engine`` does for one token-id request (a dict
with ``output_ids`` and ``meta_info["output_token_logprobs"]``), on its own event loop (``loop``), and
takes longer for longer answers, so requests finish out of the order they were added. What is checked
is the adapter (request building, stepping, conversion), not SGLang: the real engine runs in the
``gpu`` test in tests/integration/test_rollout_engines_gpu.py.
"""

from __future__ import annotations

import asyncio

import pytest
from verity.rollout import SamplingParams
from verity.rollout.requests import GenerationRequest
from verity.rollout.sglang_requests import finished_from_sglang
from verity.rollout.sglang_rollout import SGLangRollout
from verity_toyworld.char_tokenizer import CharTokenizer

EOS = 2


class AsyncStandIn:
    """Request with context c: tokens c[-1]+1, c[-1]+2, ... (EOS after ``stop_after`` unless ignored);
    each token takes one pass of the event loop."""

    def __init__(self, stop_after: int = 3) -> None:
        self.stop_after = stop_after
        self.loop = asyncio.new_event_loop()
        self.requests: list[dict] = []
        self.aborted: list[str] = []
        self.tokenizer_manager = self  # abort_request lives there in SGLang

    async def async_generate(self, input_ids, sampling_params, return_logprob, rid):
        assert return_logprob is True and isinstance(input_ids[0], int)
        self.requests.append({"rid": rid, "input_ids": input_ids, **sampling_params})
        tokens = [4 + (input_ids[-1] + k) % 200 for k in range(1, self.stop_after + 1)]
        if not sampling_params["ignore_eos"] and EOS in sampling_params["stop_token_ids"]:
            tokens.append(EOS)
        else:
            tokens += [9] * sampling_params["max_new_tokens"]
        tokens = tokens[: sampling_params["max_new_tokens"]]
        for _ in tokens:  # one pass of the event loop per token: longer answers finish later
            await asyncio.sleep(0)
        logprobs = [(-0.1 * (t + 1), tok, None) for t, tok in enumerate(tokens)]
        return {"output_ids": tokens, "meta_info": {"output_token_logprobs": logprobs}}

    def abort_request(self, rid):
        self.aborted.append(rid)

    def shutdown(self):
        self.loop.close()


@pytest.fixture
def rollout():
    out = SGLangRollout("unused", CharTokenizer(), max_model_len=64, engine=AsyncStandIn(), eos_token_ids=EOS)
    yield out
    out.close()


def drain(scheduler, plan):
    finished, steps = {}, 0
    while scheduler.pending() or any(k >= steps for k in plan):
        for request in plan.get(steps, []):
            scheduler.add(request)
        for done in scheduler.step():
            finished[done.request_id] = done
        steps += 1
        assert steps < 100
    return finished


def test_requests_are_sent_one_by_one_and_come_back_with_their_tokens(rollout):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10)
    scheduler = rollout.request_scheduler(params)
    plan = {
        0: [GenerationRequest(1, [5, 6, 7], 10), GenerationRequest(2, [8], 2)],
        1: [GenerationRequest(3, [9], 1)],
    }
    finished = drain(scheduler, plan)
    assert finished[1].token_ids == [12, 13, 14, EOS]  # the stop token ends it, kept
    assert finished[2].token_ids == [13, 14]  # cut at its own max_new_tokens
    assert finished[3].token_ids == [14]
    assert finished[1].logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    sent = {r["input_ids"][-1]: r for r in rollout.engine.requests}
    assert sent[7]["max_new_tokens"] == 10 and sent[8]["max_new_tokens"] == 2
    assert sent[7]["temperature"] == 0.7 and sent[7]["top_p"] == 0.9 and sent[7]["stop_token_ids"] == [EOS]
    assert "sampling_seed" not in sent[7]  # without deterministic inference the engine's RNG decides
    assert len({r["rid"] for r in rollout.engine.requests}) == 3
    assert scheduler.pending() == 0


def test_a_short_request_added_later_finishes_first(rollout):
    scheduler = rollout.request_scheduler(SamplingParams(do_sample=False, max_new_tokens=30, ignore_eos=True))
    scheduler.add(GenerationRequest(1, [5], 30))
    scheduler.add(GenerationRequest(2, [6], 1))
    first = scheduler.step()
    assert [done.request_id for done in first] == [2]
    assert scheduler.pending() == 1
    assert [done.request_id for done in drain(scheduler, {}).values()] == [1]
    assert rollout.engine.requests[0]["temperature"] == 0.0  # greedy


def test_seeds_come_from_the_rollouts_stream_with_deterministic_inference():
    rollout = SGLangRollout(
        "unused",
        CharTokenizer(),
        max_model_len=64,
        engine=AsyncStandIn(),
        eos_token_ids=EOS,
        enable_deterministic_inference=True,
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    rollout.set_seed(3)
    drain(rollout.request_scheduler(params), {0: [GenerationRequest(i, [5 + i], 4) for i in range(3)]})
    seeds = [r["sampling_seed"] for r in rollout.engine.requests]
    rollout.set_seed(3)
    assert [r["sampling_seed"] for r in rollout._request_params(params, 3)] == seeds
    rollout.close()


def test_the_engine_is_refused_to_others_while_requests_are_held(rollout):
    scheduler = rollout.request_scheduler(SamplingParams(max_new_tokens=4))
    scheduler.add(GenerationRequest(0, [5], 4))
    with pytest.raises(RuntimeError, match="holds 1 request"):
        rollout.load_weights([])
    with pytest.raises(RuntimeError, match="another scheduler"):
        rollout.request_scheduler(SamplingParams(max_new_tokens=4)).add(GenerationRequest(1, [5], 4))
    scheduler.close()  # aborts what it holds in SGLang and cancels its task
    assert len(rollout.engine.aborted) == 1 and scheduler.pending() == 0
    again = rollout.request_scheduler(SamplingParams(max_new_tokens=4))
    again.add(GenerationRequest(1, [5], 4))  # the engine is free again
    assert [done.request_id for done in again.step()] == [1]


def test_bad_requests_and_outputs_are_refused(rollout):
    with pytest.raises(ValueError, match="params.n must be 1"):
        rollout.request_scheduler(SamplingParams(n=2))
    scheduler = rollout.request_scheduler(SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_model_len=64"):
        scheduler.add(GenerationRequest(0, [5] * 60, 8))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        scheduler.add(GenerationRequest(0, [5], 0))
    mismatched = {
        "output_ids": [4, 5],
        "meta_info": {"output_token_logprobs": [(-1.0, 4, None), (-1.0, 6, None)]},
    }
    with pytest.raises(RuntimeError, match="do not match"):
        finished_from_sglang(0, mismatched)
