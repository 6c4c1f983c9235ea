"""Multiplication of a ``digits_a``-digit by a ``digits_b``-digit number: a task that needs a calculator.

A tiny model cannot multiply 417 by 38 in its head; with the ``calculator`` tool of the
agent loop (``rollout.agent``) it can: call the tool, read its answer, repeat it::

    prompt:    "417*38="
    response:  <tool_call>{"name": "calculator", "arguments": {"expression": "417*38"}}</tool_call><eos>
               <tool_response>15846</tool_response>                 (the tool's answer, not trained)
               15846<eos>
    answer:    "15846"

Operands are drawn uniformly among the integers with exactly that many digits; train and
test splits share no problem. The verifier :func:`score` reads the model's final answer:
the text after the last ``</tool_response>`` when the response has tool answers (the
whole exchange is what the reward manager decodes), else the whole response; cut at the
first end-of-sequence marker and newline, it must be exactly the product. A response
that ends with a tool call or a tool answer (no final answer of its own) scores 0.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

from verity_toyworld.tasks._common import cut_response, task_generators

DATA_SOURCE = "verity/multiply"
ABILITY = "math"
TOOL_ANSWER_END = "</tool_response>"

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class MultiplyConfig:
    """Difficulty knobs: ``digits_a`` and ``digits_b`` digits of the two factors (1..6 each)."""

    digits_a: int = 3
    digits_b: int = 2

    def __post_init__(self) -> None:
        for name in ("digits_a", "digits_b"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 6:
                raise ValueError(f"{name}: expected an int in 1..6, got {value!r}")


def draw_problem(rng: random.Random, config: MultiplyConfig) -> tuple[str, str, str, dict[str, Any]]:
    """One problem: ``(key, prompt, answer, extra_info)``."""
    a = rng.randint(10 ** (config.digits_a - 1) if config.digits_a > 1 else 0, 10**config.digits_a - 1)
    b = rng.randint(10 ** (config.digits_b - 1) if config.digits_b > 1 else 0, 10**config.digits_b - 1)
    expression = f"{a}*{b}"
    answer = str(a * b)
    return expression, expression + "=", answer, {"expression": expression, "answer": answer}


# generate(n, seed=0, split="train", **difficulty) and generate_splits(num_train, num_test, seed=0,
# config=None): seeded, distinct problems as verl rows (see verity_toyworld.tasks._common.task_generators).
generate, generate_splits = task_generators(draw_problem, MultiplyConfig, DATA_SOURCE, ABILITY)


def final_answer(response_text: str) -> str | None:
    """The model's final answer as integer text, or None (see the module docstring)."""
    text = response_text
    if TOOL_ANSWER_END in text:
        text = text.rsplit(TOOL_ANSWER_END, 1)[1]
    text = cut_response(text).split("\n", 1)[0].strip()
    return text if _INTEGER.fullmatch(text) else None


def score(response_text: str, ground_truth: str) -> float:
    """1.0 when the final answer equals ``ground_truth`` as an integer, else 0.0."""
    answer = final_answer(response_text)
    if answer is None:
        return 0.0
    return 1.0 if int(answer) == int(str(ground_truth).strip()) else 0.0


def tool_call_text(expression: str, tool: str = "calculator") -> str:
    """The hermes-format call of ``tool`` on ``expression`` (compact JSON: a character model pays per character)."""
    payload = json.dumps({"name": tool, "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{payload}</tool_call>"


def demonstration(
    row: dict[str, Any], use_tool: bool, tool: str = "calculator"
) -> str | list[dict[str, str]]:
    """A correct answer to ``row``: with the tool, the messages call -> tool answer -> answer; else the product."""
    answer = str(row["reward_model"]["ground_truth"])
    if not use_tool:
        return answer
    expression = str(row["extra_info"]["expression"])
    return [
        {"role": "assistant", "content": tool_call_text(expression, tool)},
        {"role": "tool", "name": tool, "content": answer},
        {"role": "assistant", "content": answer},
    ]


def tool_teacher_rows(rows: list[dict[str, Any]], tool_rate: float, seed: int = 0) -> list[dict[str, Any]]:
    """Copies of ``rows`` with a warm-start ``response``: a tool demonstration on ``tool_rate`` of them (seeded),
    the bare product on the others (which a tiny model can only imitate, not compute)."""
    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate: expected a fraction in [0, 1], got {tool_rate!r}")
    rng = random.Random(seed)
    return [{**row, "response": demonstration(row, rng.random() < tool_rate)} for row in rows]
