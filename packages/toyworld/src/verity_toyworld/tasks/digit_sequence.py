"""Digit-sequence completion: continue a short integer sequence by its next terms.

Kinds (``kinds`` knob): ``arithmetic`` (constant step), ``geometric`` (ratio 2 or 3),
``repeat`` (a block of 2..4 digits repeated) and ``fibonacci`` (each term the sum of
the two before). Example (arithmetic, shown=5, predict=2)::

    prompt:  "Continue the sequence with the next 2 terms: 3, 7, 11, 15, 19,"
    answer:  "23, 27"

The verifier :func:`score` reads the integers of the response (after the last
``Answer:`` or ``####`` if there is one, else its first non-empty line) and gives
1.0 when they begin with the expected terms in order.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from verity_toyworld.tasks._common import cut_response, task_generators

DATA_SOURCE = "verity/digit_sequence"
ABILITY = "pattern"
KINDS = ("arithmetic", "geometric", "repeat", "fibonacci")

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class DigitSequenceConfig:
    """Difficulty knobs: ``shown`` terms in the prompt (3..12), ``predict`` terms to give (1..5),
    ``max_start`` (first term up to it), ``max_step`` (arithmetic step up to it), ``kinds``."""

    shown: int = 5
    predict: int = 2
    max_start: int = 9
    max_step: int = 9
    kinds: tuple[str, ...] = ("arithmetic", "repeat")

    def __post_init__(self) -> None:
        if not isinstance(self.shown, int) or not 3 <= self.shown <= 12:
            raise ValueError(f"shown: expected an int in 3..12, got {self.shown!r}")
        if not isinstance(self.predict, int) or not 1 <= self.predict <= 5:
            raise ValueError(f"predict: expected an int in 1..5, got {self.predict!r}")
        if self.max_start < 1 or self.max_step < 1:
            raise ValueError(f"max_start/max_step: expected >= 1, got {self.max_start}/{self.max_step}")
        kinds = (self.kinds,) if isinstance(self.kinds, str) else tuple(self.kinds)
        object.__setattr__(self, "kinds", kinds)
        if not kinds or set(kinds) - set(KINDS):
            raise ValueError(f"kinds: expected a non-empty subset of {list(KINDS)}, got {list(kinds)}")


def sequence_terms(kind: str, rng: random.Random, count: int, config: DigitSequenceConfig) -> list[int]:
    """``count`` terms of a random sequence of ``kind``."""
    if kind == "arithmetic":
        start, step = rng.randint(0, config.max_start), rng.randint(1, config.max_step)
        return [start + step * i for i in range(count)]
    if kind == "geometric":
        start, ratio = rng.randint(1, config.max_start), rng.choice((2, 3))
        return [start * ratio**i for i in range(count)]
    if kind == "repeat":
        block = [rng.randint(0, 9) for _ in range(rng.randint(2, 4))]
        while len(set(block)) == 1:
            block = [rng.randint(0, 9) for _ in range(len(block))]
        return [block[i % len(block)] for i in range(count)]
    if kind == "fibonacci":
        terms = [rng.randint(0, config.max_start), rng.randint(1, config.max_start)]
        while len(terms) < count:
            terms.append(terms[-1] + terms[-2])
        return terms[:count]
    raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")


def draw_problem(rng: random.Random, config: DigitSequenceConfig) -> tuple[str, str, str, dict[str, Any]]:
    """One problem: ``(key, prompt, answer, extra_info)``."""
    kind = rng.choice(config.kinds)
    terms = sequence_terms(kind, rng, config.shown + config.predict, config)
    shown, rest = terms[: config.shown], terms[config.shown :]
    prompt = (
        f"Continue the sequence with the next {config.predict} term{'s' if config.predict > 1 else ''}: "
        + ", ".join(map(str, shown))
        + ","
    )
    answer = ", ".join(map(str, rest))
    return prompt, prompt, answer, {"kind": kind}


# generate(n, seed=0, split="train", **difficulty) and generate_splits(num_train, num_test, seed=0,
# config=None): seeded, distinct problems as verl rows (see verity_toyworld.tasks._common.task_generators).
generate, generate_splits = task_generators(draw_problem, DigitSequenceConfig, DATA_SOURCE, ABILITY)


def extract_terms(response_text: str) -> list[int]:
    """The integers of the answer part of a response (see the module docstring)."""
    text = cut_response(response_text)
    for marker in ("####", "Answer:", "answer:"):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
            break
    else:
        lines = [line for line in text.split("\n") if line.strip()]
        text = lines[0] if lines else ""
    return [int(x) for x in _INTEGER.findall(text)]


def score(response_text: str, ground_truth: str) -> float:
    """1.0 when the response's integers begin with the expected terms, else 0.0."""
    expected = [int(x) for x in _INTEGER.findall(str(ground_truth))]
    got = extract_terms(response_text)
    return 1.0 if expected and got[: len(expected)] == expected else 0.0
