"""Countdown: combine the given numbers with + - * / into an expression equal to the target.

Every number must be used exactly once. Problems are built backwards from a
random expression over the numbers, so each has at least one solution (kept in
``extra_info["solution"]``). Example::

    prompt:  "Using the numbers [3, 5, 2], write an expression that equals 16. Use + - * / and
              each number exactly once. Put it in <answer></answer>."
    ground_truth: '{"target": 16, "numbers": [3, 5, 2]}'      (a JSON string)
    a correct response: "<answer>(3 + 5) * 2</answer>"

The verifier :func:`score` takes the last ``<answer>...</answer>``, parses it with
``ast`` (numbers, + - * /, parentheses; nothing else is evaluated), checks the
numbers used are exactly the given ones, and evaluates it with exact fractions.
"""

from __future__ import annotations

import ast
import json
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from verity_toyworld.tasks._common import cut_response, task_generators

DATA_SOURCE = "verity/countdown"
ABILITY = "math"

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclass(frozen=True)
class CountdownConfig:
    """Difficulty knobs: ``num_count`` numbers (2..6) drawn from 1..``max_number``, a target in
    1..``max_target``, built with ``operations`` (a subset of ``"+-*/"``)."""

    num_count: int = 3
    max_number: int = 10
    max_target: int = 100
    operations: str = "+-*/"

    def __post_init__(self) -> None:
        if not isinstance(self.num_count, int) or not 2 <= self.num_count <= 6:
            raise ValueError(f"num_count: expected an int in 2..6, got {self.num_count!r}")
        if not isinstance(self.max_number, int) or self.max_number < 2:
            raise ValueError(f"max_number: expected an int >= 2, got {self.max_number!r}")
        if not isinstance(self.max_target, int) or self.max_target < 1:
            raise ValueError(f"max_target: expected an int >= 1, got {self.max_target!r}")
        if not self.operations or set(self.operations) - set("+-*/"):
            raise ValueError(f"operations: expected a non-empty subset of '+-*/', got {self.operations!r}")


def _combine(rng: random.Random, numbers: list[int], operations: str) -> tuple[str, Fraction] | None:
    """A random expression using every number once, and its exact value (None if it divides by zero)."""
    parts: list[tuple[str, Fraction]] = [(str(n), Fraction(n)) for n in numbers]
    while len(parts) > 1:
        i, j = rng.sample(range(len(parts)), 2)
        (left, a), (right, b) = parts[i], parts[j]
        op = rng.choice(operations)
        if op == "/" and (b == 0 or (a / b).denominator != 1):
            others = operations.replace("/", "")
            if not others:
                return None  # only division allowed and it is not exact here: draw again
            op = rng.choice(others)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else Fraction(0)}[op]
        merged = (f"({left} {op} {right})", value)
        parts = [p for k, p in enumerate(parts) if k not in (i, j)] + [merged]
    text, value = parts[0]
    return (text[1:-1] if text.startswith("(") else text), value


def draw_problem(rng: random.Random, config: CountdownConfig) -> tuple[str, str, str, dict[str, Any]]:
    """One solvable problem: ``(key, prompt, ground_truth JSON, extra_info)``."""
    while True:
        numbers = [rng.randint(1, config.max_number) for _ in range(config.num_count)]
        built = _combine(rng, numbers, config.operations)
        if built is None:
            continue
        expression, value = built
        if value.denominator == 1 and 1 <= value <= config.max_target:
            break
    target = int(value)
    prompt = (
        f"Using the numbers {numbers}, write an expression that equals {target}. "
        "Use + - * / and each number exactly once. Put it in <answer></answer>."
    )
    truth = json.dumps({"target": target, "numbers": numbers})
    return truth, prompt, truth, {"solution": expression}


# generate(n, seed=0, split="train", **difficulty) and generate_splits(num_train, num_test, seed=0,
# config=None): seeded, distinct problems as verl rows (see verity_toyworld.tasks._common.task_generators).
generate, generate_splits = task_generators(draw_problem, CountdownConfig, DATA_SOURCE, ABILITY)


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ZeroDivisionError("division by zero in the answer")
        return left / right
    raise ValueError(f"not allowed in a countdown answer: {type(node).__name__}")


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integers it uses; ValueError if it is anything else."""
    if len(expression) > 200 or not re.fullmatch(r"[\d\s+\-*/()]+", expression):
        raise ValueError(f"not an arithmetic expression: {expression[:50]!r}")
    used: list[int] = []
    return _evaluate(ast.parse(expression.strip(), mode="eval"), used), used


def score(response_text: str, ground_truth: str | dict) -> float:
    """1.0 when the last ``<answer>`` uses exactly the given numbers and equals the target, else 0.0."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    answers = _ANSWER.findall(cut_response(response_text))
    if not answers:
        return 0.0
    try:
        value, used = evaluate_expression(answers[-1])
    except (ValueError, SyntaxError, ZeroDivisionError):
        return 0.0
    if sorted(used) != sorted(int(n) for n in truth["numbers"]):
        return 0.0
    return 1.0 if value == Fraction(int(truth["target"])) else 0.0
