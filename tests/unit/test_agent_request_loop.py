"""The request-level agent loop: same trajectories as the turn-synchronous barrier, no waiting on others.

Greedy decoding and deterministic tools: both policies of
:mod:`verity.rollout.agent.scheduling` must give every row the same tokens, masks, log-probs
and trajectory record, with the scripted policy (every token's author known) and with the
real HF engine (through its own ``request_scheduler`` and through the one-call-per-step
:class:`BatchedCallScheduler`). Ordering claims are checked on the engine's calls, never on
wall-clock thresholds.
"""

from __future__ import annotations

import pytest
import torch
from helpers.agent_plugin import TOOL_TEMPLATE, ScriptedRollout
from helpers.light_tools import light_tools
from verity.batch import Batch
from verity.rollout import HFRollout, SamplingParams
from verity.rollout.agent.config import AgentConfig, ToolConfig
from verity.rollout.agent.loop import AgentRollout
from verity.rollout.agent.metrics import agent_batch_metrics
from verity.rollout.agent.parsers import TOOL_PARSERS, ParsedTurn, ToolCall, register_tool_parser
from verity.rollout.agent.scheduling import REQUEST_LEVEL, TURN_BARRIER
from verity.rollout.prompts import encode_prompts
from verity.rollout.requests import BatchedCallScheduler
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2_for


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = CharTokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    model = build_tiny_qwen2_for(
        tokenizer, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, max_pos=512
    )
    return model.eval(), tokenizer


def agent_config(**overrides) -> AgentConfig:
    values = {"enabled": True, "max_turns": 4, "tools": [ToolConfig(**t) for t in light_tools(3.0)]}
    values.update(overrides)
    return AgentConfig(**values)


def prompt_batch(tokenizer, prompts: list[str]) -> Batch:
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in prompts])
    return Batch.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]},
        non_tensors={"extra_info": [{} for _ in prompts]},
    )


def both_policies(agent: AgentRollout, batch: Batch, params: SamplingParams) -> tuple[Batch, Batch]:
    request = agent.generate_with_policy(batch, params, REQUEST_LEVEL)
    barrier = agent.generate_with_policy(batch, params, TURN_BARRIER)
    return request, barrier


def assert_same_rollouts(a: Batch, b: Batch) -> None:
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["response_mask"], b["response_mask"])
    assert torch.equal(a["attention_mask"], b["attention_mask"])
    assert torch.allclose(a["rollout_logprobs"], b["rollout_logprobs"], atol=1e-6, rtol=0)
    assert a["trajectory"] == b["trajectory"]
    for key in ("num_turns", "tool_calls", "tool_errors", "tool_tokens"):
        assert torch.equal(a[key], b[key]), key


SCRIPTED = [
    "task:calculator:12*34|",
    "task:echo*3:hi|",
    "task:plain:7|",
    "task:badjson:x|",
    "task:unknown:x|",
    "task:two:2*3|",
    "task:loop:1+1|",
    "task:echo*2:a much longer argument|",
]


def test_scripted_rollouts_are_the_same_under_both_policies(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    agent = AgentRollout(
        ScriptedRollout(model, tokenizer), tokenizer, agent_config(tool_workers=2), max_model_len=512
    )
    try:
        request, barrier = both_policies(
            agent, prompt_batch(tokenizer, SCRIPTED), SamplingParams(max_new_tokens=420)
        )
    finally:
        agent.close()
    assert_same_rollouts(request, barrier)
    assert request["num_turns"].tolist() == [2, 4, 1, 2, 2, 2, 4, 3]
    assert [t["stop"] for t in request["trajectory"]] == ["answer"] * 6 + ["max_turns", "answer"]
    metrics = agent_batch_metrics(request)
    assert metrics["agent/requests_in_flight_max"] == 8  # every first turn in flight at once
    assert 0 < metrics["agent/engine_busy_fraction"] <= 1
    assert metrics["agent/tool_wait_s_mean"] > 0 and metrics["agent/tool_queue_s_mean"] >= 0
    assert float(request["tool_wait_s"][2]) == 0.0  # the row that called nothing waited for nothing


class _EveryTurnCalls:
    """A parser that makes every turn a call to ``echo`` with the turn's first characters."""

    def __call__(self, text: str) -> ParsedTurn:
        return ParsedTurn(calls=[ToolCall("echo", {"text": text[:5]})])


@pytest.fixture(scope="module")
def every_turn_parser():
    register_tool_parser("test-request-every-turn", _EveryTurnCalls())
    yield "test-request-every-turn"
    TOOL_PARSERS._entries.pop("test-request-every-turn")
    TOOL_PARSERS._canonical.pop("test-request-every-turn")


class _OneCallPerStep(HFRollout):
    """The HF engine behind the default scheduler: one ``generate`` call per step."""

    def request_scheduler(self, params):
        return BatchedCallScheduler(self, params, self.pad_token_id)


@pytest.mark.parametrize(
    "engine_class", [HFRollout, _OneCallPerStep], ids=["own-scheduler", "one-call-per-step"]
)
def test_greedy_hf_rollouts_are_the_same_under_both_policies(
    model_and_tokenizer, every_turn_parser, engine_class
) -> None:
    model, tokenizer = model_and_tokenizer
    config = agent_config(tool_parser=every_turn_parser, max_turns=3, max_turn_tokens=6, tool_workers=0)
    agent = AgentRollout(engine_class(model, tokenizer, seed=0), tokenizer, config, max_model_len=512)
    batch = prompt_batch(tokenizer, ["1+2=", "a longer prompt here:", "x", "hello"])
    request, barrier = both_policies(agent, batch, SamplingParams(max_new_tokens=40, temperature=0.0))
    assert_same_rollouts(request, barrier)
    assert int(request["tool_calls"].sum()) > 0


class _RecordingScripted(ScriptedRollout):
    """Records the decoded contexts of every engine call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[list[str]] = []

    def generate(self, batch, params=None):
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        self.calls.append(
            [
                self.tokenizer.decode(i[m].tolist(), skip_special_tokens=False)
                for i, m in zip(ids, mask, strict=True)
            ]
        )
        return super().generate(batch, params)


def _first_call(calls: list[list[str]], task: str, turn: int) -> int:
    """Index of the engine call that generated ``task``'s ``turn``-th turn (0-based)."""
    for index, contexts in enumerate(calls):
        if any(task in c and c.count("<eos>") == turn for c in contexts):
            return index
    raise AssertionError(f"no call generated turn {turn} of {task}")


@pytest.mark.parametrize("policy", [REQUEST_LEVEL, TURN_BARRIER])
def test_a_hanging_tool_holds_up_only_its_own_trajectory(model_and_tokenizer, policy) -> None:
    model, tokenizer = model_and_tokenizer
    engine = _RecordingScripted(model, tokenizer)
    config = agent_config(tool_workers=2, max_tool_response_tokens=20)
    agent = AgentRollout(engine, tokenizer, config, max_model_len=512)
    prompts = ["task:hang:a|", "task:echo*3:b|", "task:echo*3:c|", "task:flood:d|", "task:fail:e|"]
    try:
        agent.executor._get_pool().warm_up(__import__, ("helpers.light_tools",))
        out = agent.generate_with_policy(
            prompt_batch(tokenizer, prompts), SamplingParams(max_new_tokens=300), policy
        )
    finally:
        agent.close()
    answers = [[m for m in t["messages"] if m["role"] == "tool"] for t in out["trajectory"]]
    assert answers[0][0]["status"] == "timeout" and answers[4][0]["status"] == "exception"
    assert answers[3][0]["status"] == "ok" and answers[3][0]["content"] == "y" * 10 + "..." + "y" * 10
    assert [t["stop"] for t in out["trajectory"]] == ["answer"] * 5  # every row read its error and went on
    hang_answered = _first_call(engine.calls, "task:hang", 1)
    fast_done = max(_first_call(engine.calls, f"task:echo*3:{x}", 3) for x in "bc")
    if policy == REQUEST_LEVEL:
        # the echo rows ran all their turns and tools while the hanging call waited for its deadline
        assert fast_done < hang_answered
    else:
        assert fast_done > hang_answered  # the barrier holds every row's next turn behind the hang


def test_a_context_with_no_room_left_is_refused(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    agent = AgentRollout(
        ScriptedRollout(model, tokenizer), tokenizer, agent_config(tool_workers=0), max_model_len=12
    )
    with pytest.raises(ValueError, match="max_model_len=12: a context of 14 tokens leaves no room"):
        agent.generate(prompt_batch(tokenizer, ["task:plain:7|"]), SamplingParams(max_new_tokens=8))


def test_tensor_parallel_engines_use_the_barrier(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer

    class _TwoRanks(ScriptedRollout):
        tensor_parallel_size = 2

    agent = AgentRollout(_TwoRanks(model, tokenizer), tokenizer, agent_config(tool_workers=0))
    plain = AgentRollout(ScriptedRollout(model, tokenizer), tokenizer, agent_config(tool_workers=0))
    assert agent._policy() == TURN_BARRIER and plain._policy() == REQUEST_LEVEL
