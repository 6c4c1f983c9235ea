"""Warm-starting tool use: the multiply-tools preset's teacher and the SFT layout of its demonstrations."""

from __future__ import annotations

import pytest
from verity.rollout.agent.calculator import Calculator
from verity.rollout.agent.parsers import parse_hermes
from verity.sft import IGNORE_INDEX, collate_examples, multi_turn_target, tokenize_examples
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.presets import EMBEDDED_PRESETS, SFT_TEACHERS
from verity_toyworld.tasks import multiply


def test_the_multiply_tools_teacher_demonstrates_calls_the_calculator_answers_right() -> None:
    settings = EMBEDDED_PRESETS.get("multiply-tools")
    rows = multiply.generate(300, seed=1, **settings.task_config)
    taught = SFT_TEACHERS.get(settings.teacher)(rows, settings)
    with_tool = [r for r in taught if isinstance(r["response"], list)]
    assert 0.2 < len(with_tool) / len(rows) < 0.4  # tool_rate 0.3
    calculator = Calculator({})
    for row in with_tool:
        call, answer, final = row["response"]
        parsed = parse_hermes(call["content"])
        assert parsed.errors == [] and parsed.calls[0].name == "calculator"
        # the demonstrated tool answer is what the real calculator answers
        assert answer == {
            "role": "tool",
            "name": "calculator",
            "content": calculator.execute(parsed.calls[0].arguments),
        }
        assert final["content"] == row["reward_model"]["ground_truth"]
    plain = [r for r in taught if not isinstance(r["response"], list)]
    assert all(r["response"] == r["reward_model"]["ground_truth"] for r in plain)


def test_a_multi_turn_demonstration_trains_the_assistant_turns_only() -> None:
    tokenizer = CharTokenizer()
    messages = multiply.demonstration(
        {"reward_model": {"ground_truth": "15846"}, "extra_info": {"expression": "417*38"}}, use_tool=True
    )
    ids, trained = multi_turn_target(tokenizer, messages)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    call = messages[0]["content"]
    assert text == f"{call}<eos><tool_response>15846</tool_response>15846<eos>"
    flags = "".join(str(t) for t in trained)
    assert flags == "1" * (len(call) + 1) + "0" * len("<tool_response>15846</tool_response>") + "1" * 6
    # collated: the tool answer has label -100, the model's turns their own ids
    row = {"prompt": [{"role": "user", "content": "417*38="}], "response": messages}
    batch = collate_examples(tokenize_examples(tokenizer, [row]), tokenizer.pad_token_id)
    prompt_len = len(tokenizer("<bos>417*38=", add_special_tokens=False)["input_ids"])
    labels = batch["labels"][0, prompt_len : prompt_len + len(ids)].tolist()
    assert labels == [i if t else IGNORE_INDEX for i, t in zip(ids, trained, strict=True)]


def test_a_demonstration_with_a_stray_role_is_refused() -> None:
    with pytest.raises(ValueError, match="expected role 'assistant' or 'tool'"):
        multi_turn_target(CharTokenizer(), [{"role": "user", "content": "x"}])
