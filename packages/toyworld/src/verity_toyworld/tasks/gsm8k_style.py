"""Synthetic GSM8K-style word problems whose answer follows ``####``.

A problem starts with a quantity of one item and applies ``steps`` changes, each
drawn from ``operations``: ``+`` (buys more), ``-`` (gives some away; never below
zero) and ``*`` (ends up with k times as many, k in 2..4). Example (steps=2)::

    prompt:  "Ann has 12 pens. Ann buys 7 more pens. Ann gives 5 pens to Bob.
              How many pens does Ann have now? Give the final answer after ####."
    answer:  "14"        (the reference solution in extra_info ends with "#### 14")

The verifier :func:`score` reads the number after the last ``####`` in the
response, exactly like the GSM8K strict reward, and compares integers.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from typing import Any

from verity_toyworld.tasks._common import cut_response, task_generators

DATA_SOURCE = "verity/gsm8k_style"
ABILITY = "math"
INSTRUCTION = "Give the final answer after ####."

_NAMES = ("Ann", "Bob", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jo", "Kim")
_ITEMS = ("pens", "eggs", "cups", "hats", "apples", "coins", "books", "toys")
_FINAL = re.compile(r"####\s*\$?\s*(-?[\d,]+)")


@dataclass(frozen=True)
class GSM8KStyleConfig:
    """Difficulty knobs: ``steps`` changes per problem (1..6), starting and step quantities up to
    ``max_value`` (>= 2), allowed ``operations`` (a subset of ``"+-*"``)."""

    steps: int = 2
    max_value: int = 20
    operations: str = "+-"

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or not 1 <= self.steps <= 6:
            raise ValueError(f"steps: expected an int in 1..6, got {self.steps!r}")
        if not isinstance(self.max_value, int) or self.max_value < 2:
            raise ValueError(f"max_value: expected an int >= 2, got {self.max_value!r}")
        if not self.operations or set(self.operations) - set("+-*"):
            raise ValueError(f"operations: expected a non-empty subset of '+-*', got {self.operations!r}")


def draw_problem(rng: random.Random, config: GSM8KStyleConfig) -> tuple[str, str, str, dict[str, Any]]:
    """One problem: ``(key, prompt, answer, extra_info)``; the reference solution is ``extra_info["solution"]``."""
    name, friend = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    total = rng.randint(1, config.max_value)
    sentences = [f"{name} has {total} {item}."]
    work = []
    for _ in range(config.steps):
        op = rng.choice(config.operations)
        if op == "-" and total == 0:
            op = "+"
        if op == "+":
            k = rng.randint(1, config.max_value)
            sentences.append(f"{name} buys {k} more {item}.")
            work.append(f"{total} + {k} = {total + k}")
            total += k
        elif op == "-":
            k = rng.randint(1, total)
            sentences.append(f"{name} gives {k} {item} to {friend}.")
            work.append(f"{total} - {k} = {total - k}")
            total -= k
        else:
            k = rng.randint(2, 4)
            sentences.append(f"{name} ends up with {k} times as many {item}.")
            work.append(f"{total} * {k} = {total * k}")
            total *= k
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    solution = "\n".join(work) + f"\n#### {total}"
    return question, f"{question} {INSTRUCTION}", str(total), {"solution": solution}


# generate(n, seed=0, split="train", **difficulty) and generate_splits(num_train, num_test, seed=0,
# config=None): seeded, distinct problems as verl rows (see verity_toyworld.tasks._common.task_generators).
generate, generate_splits = task_generators(draw_problem, GSM8KStyleConfig, DATA_SOURCE, ABILITY)


def extract_answer(response_text: str) -> str | None:
    """The integer after the last ``####`` (commas removed), or None."""
    matches = _FINAL.findall(cut_response(response_text))
    if not matches:
        return None
    value = matches[-1].replace(",", "")
    return value if re.fullmatch(r"-?\d+", value) else None


def score(response_text: str, ground_truth: str | int) -> float:
    """1.0 when the number after the last ``####`` equals ``ground_truth``, else 0.0."""
    answer = extract_answer(response_text)
    return 1.0 if answer is not None and int(answer) == int(str(ground_truth).strip()) else 0.0


def config_dict(config: GSM8KStyleConfig) -> dict[str, Any]:
    """The knobs as a plain dict."""
    return asdict(config)
