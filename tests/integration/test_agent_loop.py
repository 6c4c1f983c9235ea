"""The agent loop in one process: exact masks, log-probs, budgets, limits, misbehaving tools.

The policy is scripted (``helpers.agent_plugin.script``, teacher-forced through a real tiny
model) so every token's author is known; the real HF engine runs under the loop too, with
a parser that turns every turn into a call. Tool calls run in worker processes (the
executor's pool), as in training.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.agent_plugin import (
    TOOL_TEMPLATE,
    ScriptedRollout,
    expected_response,
    intended_turn,
    script,
    scripted_tools,
)
from verity.batch import Batch
from verity.engines.logprobs import response_logprobs
from verity.rollout import HFRollout, SamplingParams
from verity.rollout.agent.config import AgentConfig, ToolConfig
from verity.rollout.agent.loop import AgentRollout
from verity.rollout.agent.parsers import TOOL_PARSERS, ParsedTurn, ToolCall, register_tool_parser
from verity.rollout.prompts import encode_prompts
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
    values = {"enabled": True, "max_turns": 3, "tools": [ToolConfig(**t) for t in scripted_tools(2.0)]}
    values.update(overrides)
    return AgentConfig(**values)


def prompt_batch(tokenizer, prompts: list[str], extra_info: list | None = None) -> Batch:
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in prompts])
    extras = extra_info or [{} for _ in prompts]
    return Batch.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]},
        non_tensors={"extra_info": extras},
    )


def trainer_logprobs(model, out: Batch, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logprobs, _ = response_logprobs(
            model,
            {k: out[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")},
            temperature=temperature,
            compute_entropy=False,
        )
    return logprobs


PROMPTS = [
    "task:calculator:12*34|",
    "task:echo:hi|",
    "task:plain:7|",
    "task:badjson:x|",
    "task:unknown:x|",
    "task:badargs:x|",
    "task:two:2*3|",
    "task:loop:1+1|",
]


def test_a_scripted_trajectory_has_exactly_the_model_tokens_in_response_mask(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    engine = ScriptedRollout(model, tokenizer)
    agent = AgentRollout(engine, tokenizer, agent_config(), max_model_len=512)
    extras = [{} for _ in PROMPTS]
    extras[1] = {
        "tools_kwargs": {"echo": {"create_kwargs": {"user": "u1"}, "execute_kwargs": {"lang": "en"}}}
    }
    try:
        out = agent.generate(
            prompt_batch(tokenizer, PROMPTS, extras), SamplingParams(max_new_tokens=320, temperature=0.7)
        )
    finally:
        agent.close()
    trajectories = out["trajectory"]
    assert all(t["stop"] != "budget" for t in trajectories)
    for row, trajectory in enumerate(trajectories):
        tokens, mask = expected_response(tokenizer, "<bos>" + PROMPTS[row], trajectory)
        n = len(tokens)
        assert out["responses"][row, :n].tolist() == tokens, f"row {row}: {trajectory}"
        assert out["response_mask"][row].tolist() == mask + [0] * (320 - n)
        assert out["attention_mask"][row, -320:].tolist() == [1] * n + [0] * (320 - n)
    by_row = {p.split(":")[1]: t for p, t in zip(PROMPTS, trajectories, strict=True)}
    tool = {k: [m for m in t["messages"] if m["role"] == "tool"] for k, t in by_row.items()}
    assert (
        tool["calculator"][0]["content"] == "408"
        and by_row["calculator"]["messages"][-1]["content"] == "=408"
    )
    assert json.loads(tool["echo"][0]["content"]) == {"kwargs": {"lang": "en", "user": "u1"}, "text": "hi"}
    assert tool["plain"] == [] and by_row["plain"]["stop"] == "answer" and by_row["plain"]["num_turns"] == 1
    assert tool["badjson"][0]["status"] == "parse" and "not valid JSON" in tool["badjson"][0]["content"]
    assert (
        tool["unknown"][0]["status"] == "unknown_tool" and "no tool 'nosuch'" in tool["unknown"][0]["content"]
    )
    assert tool["badargs"][0]["status"] == "bad_arguments"
    assert [m["status"] for m in tool["two"]] == ["ok", "too_many_calls"]  # max_parallel_calls=1
    assert by_row["loop"]["stop"] == "max_turns" and by_row["loop"]["num_turns"] == 3
    assert out["tool_calls"].tolist() == [1, 1, 0, 1, 1, 1, 2, 2]
    assert out["tool_errors"].tolist() == [0, 0, 0, 1, 1, 1, 1, 0]
    assert out["num_turns"].tolist() == [2, 2, 1, 2, 2, 2, 2, 3]
    # the sampler's log-probs of the model's tokens are the trainer's; none on tool tokens
    trained = trainer_logprobs(model, out, temperature=0.7)
    mask = out["response_mask"].bool()
    assert torch.allclose(out["rollout_logprobs"][mask], trained[mask], atol=1e-5)
    assert bool((out["rollout_logprobs"][~mask] == 0).all())


def test_misbehaving_tools_cost_one_error_message_each_and_the_round_goes_on(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    agent = AgentRollout(ScriptedRollout(model, tokenizer), tokenizer, agent_config(), max_model_len=512)
    prompts = ["task:hang:a|", "task:crash:b|", "task:garbage:c|", "task:fail:d|", "task:calculator:6*7|"]
    try:
        out = agent.generate(prompt_batch(tokenizer, prompts), SamplingParams(max_new_tokens=200))
        again = agent.generate(prompt_batch(tokenizer, prompts[-1:]), SamplingParams(max_new_tokens=200))
    finally:
        agent.close()
    answers = [[m for m in t["messages"] if m["role"] == "tool"] for t in out["trajectory"]]
    assert [a[0]["status"] for a in answers] == ["timeout", "crash", "bad_result", "exception", "ok"]
    assert answers[0][0]["content"] == "Error: hang did not answer within 2 s"
    assert answers[1][0]["content"].startswith("Error: crash crashed (worker process died")
    assert answers[2][0]["content"] == "Error: garbage failed: the tool returned bytes, not text"
    assert answers[3][0]["content"] == "Error: fail failed: RuntimeError: the index is offline"
    assert answers[4][0]["content"] == "42"
    assert out["tool_errors"].tolist() == [1, 1, 1, 1, 0]
    assert [t["error_kinds"] for t in out["trajectory"][:4]] == [
        {"timeout": 1},
        {"crash": 1},
        {"bad_result": 1},
        {"exception": 1},
    ]
    # every row still finished its trajectory: the model read the error and answered
    assert [t["stop"] for t in out["trajectory"]] == ["answer"] * 5
    assert [m["content"] for m in again["trajectory"][0]["messages"] if m["role"] == "tool"] == ["42"]


def test_the_budget_counts_tool_tokens_and_cuts_long_answers(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    agent = AgentRollout(
        ScriptedRollout(model, tokenizer),
        tokenizer,
        agent_config(max_tool_response_tokens=10),
        max_model_len=512,
    )
    try:
        cut = agent.generate(
            prompt_batch(tokenizer, ["task:echo:" + "z" * 40 + "|"]), SamplingParams(max_new_tokens=200)
        )
        call = tokenizer(script("<bos>task:calculator:99*99|"), add_special_tokens=False)["input_ids"]
        budget = len(call) + 1 + 3  # the call, EOS, and 3 of the 6 answer tokens "[9801]"
        short = agent.generate(
            prompt_batch(tokenizer, ["task:calculator:99*99|"]), SamplingParams(max_new_tokens=budget)
        )
    finally:
        agent.close()
    answer = [m for m in cut["trajectory"][0]["messages"] if m["role"] == "tool"][0]["content"]
    assert answer.startswith('{"kwa') and answer.endswith('zz"}') and "..." in answer
    assert len(tokenizer(answer.replace("...", ""), add_special_tokens=False)["input_ids"]) == 10
    assert short["trajectory"][0]["stop"] == "budget"
    assert short["responses"].shape[1] == budget
    assert short["attention_mask"][0, -budget:].tolist() == [1] * budget
    assert short["response_mask"][0].tolist() == [1] * (budget - 3) + [0, 0, 0]
    assert tokenizer.decode(short["responses"][0, -3:].tolist()) == "[98"


class _EveryTurnCalls:
    """A parser that makes every turn a call to ``echo`` with the turn's text."""

    def __call__(self, text: str) -> ParsedTurn:
        return ParsedTurn(calls=[ToolCall("echo", {"text": text[:8]})])


@pytest.fixture(scope="module")
def every_turn_parser():
    register_tool_parser("test-every-turn", _EveryTurnCalls())
    yield "test-every-turn"
    TOOL_PARSERS._entries.pop("test-every-turn")
    TOOL_PARSERS._canonical.pop("test-every-turn")


@pytest.mark.parametrize("n", [1, 2])
def test_the_hf_engine_under_the_loop_samples_log_probs_the_trainer_reproduces(
    model_and_tokenizer, every_turn_parser, n
) -> None:
    model, tokenizer = model_and_tokenizer
    config = agent_config(tool_parser=every_turn_parser, max_turns=3, max_turn_tokens=6, tool_workers=0)
    agent = AgentRollout(HFRollout(model, tokenizer, seed=3), tokenizer, config, max_model_len=512)
    prompts = ["1+2=", "a longer prompt here:", "x"]
    out = agent.generate(
        prompt_batch(tokenizer, prompts), SamplingParams(max_new_tokens=64, temperature=1.0, n=n)
    )
    assert out["responses"].shape == (3 * n, 64)
    if n > 1:
        assert out["group"].tolist() == [0, 0, 1, 1, 2, 2]
    mask, attention = out["response_mask"].bool(), out["attention_mask"][:, -64:].bool()
    for row in range(3 * n):
        flags = mask[row][attention[row]].tolist()
        runs = [len(r) for r in "".join("m" if f else "t" for f in flags).replace("t", " ").split()]
        turns = out["num_turns"][row].item()
        assert len(runs) == turns and all(r <= 6 for r in runs)  # max_turn_tokens per model turn
        assert out["tool_calls"][row].item() == turns - 1 or out["trajectory"][row]["stop"] == "budget"
    trained = trainer_logprobs(model, out, temperature=1.0)
    assert torch.allclose(out["rollout_logprobs"][mask], trained[mask], atol=1e-4)
    assert bool((out["rollout_logprobs"][~mask] == 0).all())


class _RecordingScripted(ScriptedRollout):
    """Records each call's ``max_new_tokens``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def generate(self, batch, params=None):
        self.calls.append(params.max_new_tokens)
        return super().generate(batch, params)


def test_the_max_model_len_cap_continues_a_turn_in_the_next_call(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    prompts = ["task:echo:" + "w" * 30 + "|", "task:loop:1+1|"]
    batch = prompt_batch(tokenizer, prompts)
    budget = 190
    engine = _RecordingScripted(model, tokenizer)
    # max_model_len = longest prompt + budget, as the actor worker sets it: after the first round the
    # echo row (97 model + 58 tool tokens) has used more of its budget than the loop row (82 + 3), so
    # the cap leaves 35 tokens for the second call and the loop row's 82-token second turn is cut
    agent = AgentRollout(
        engine, tokenizer, agent_config(), max_model_len=batch["input_ids"].shape[1] + budget
    )
    try:
        out = agent.generate(batch, SamplingParams(max_new_tokens=budget, temperature=1.0))
    finally:
        agent.close()
    loop_turn = intended_turn("loop", "1+1", 1, None)
    assert len(engine.calls) >= 3 and engine.calls[1] < len(tokenizer(loop_turn)["input_ids"]) + 1
    second = [m for m in out["trajectory"][1]["messages"] if m["role"] == "assistant"][1]
    assert second["content"] == loop_turn  # one turn, written over two engine calls
    tokens, mask = expected_response(tokenizer, "<bos>" + prompts[1], out["trajectory"][1])
    n = min(len(tokens), budget)
    assert out["responses"][1, :n].tolist() == tokens[:n] and out["response_mask"][1, :n].tolist() == mask[:n]
    trained = trainer_logprobs(model, out, temperature=1.0)
    mask = out["response_mask"].bool()
    assert torch.allclose(out["rollout_logprobs"][mask], trained[mask], atol=1e-5)
