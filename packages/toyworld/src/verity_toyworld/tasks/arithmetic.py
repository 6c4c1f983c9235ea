"""Synthetic arithmetic word problems with one integer answer (the embedded default task).

A problem is a chain of ``operands`` integers of ``digits`` digits joined by
operations drawn from ``operations`` (``+`` and/or ``-``), evaluated left to
right. With ``allow_negative=False`` (the default) every running total stays
at or above zero: a subtrahend is redrawn no larger than the running total.
The prompt is short, because a character model pays for every character:

- ``style="word"``:  ``"Ann has 23 pens, gets 14, loses 5. Now? "`` -> ``"32"``
- ``style="expr"``:  ``"23+14-5="`` -> ``"32"``

Rows follow the verl schema::

    {"prompt": [{"role": "user", "content": <prompt text>}],
     "data_source": "verity/arithmetic", "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "32"},
     "extra_info": {"split": "train", "index": 0, "expression": "23+14-5", "answer": "32"}}

Train and test splits never share an expression (the word wrapper is
irrelevant to the answer, so problems are deduplicated on the expression).
The verifier :func:`score` gives 1.0 when the response starts with the exact
integer answer, ended by EOS, a newline or the end of the text.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DATA_SOURCE = "verity/arithmetic"
ABILITY = "math"

_NAMES = ("Ann", "Bob", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jo", "Kim", "Lu", "Max")
_ITEMS = ("pens", "eggs", "cups", "hats", "apples", "coins", "books", "toys")
_WORD_FOR_OP = {"+": "gets", "-": "loses"}
_EOS_MARKERS = ("<eos>", "<|im_end|>", "<|endoftext|>", "</s>")
_LEADING_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs of the arithmetic task.

    ``digits``: each operand is drawn uniformly from the integers with at most
    this many digits (0 .. 10**digits - 1); ``operations``: a string of the
    allowed operators, a subset of ``"+-"``; ``operands``: how many numbers per
    problem (>= 2); ``style``: ``"word"`` or ``"expr"`` (see the module docstring).
    """

    digits: int = 2
    operations: str = "+-"
    operands: int = 2
    style: str = "word"
    allow_negative: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
            raise ValueError(f"digits: expected an int in 1..9, got {self.digits!r}")
        if not self.operations or set(self.operations) - set("+-"):
            raise ValueError(f"operations: expected a non-empty subset of '+-', got {self.operations!r}")
        if not isinstance(self.operands, int) or self.operands < 2:
            raise ValueError(f"operands: expected an int >= 2, got {self.operands!r}")
        if self.style not in ("word", "expr"):
            raise ValueError(f"style: expected 'word' or 'expr', got {self.style!r}")

    def to_dict(self) -> dict[str, Any]:
        """The knobs as a plain dict (for hashing and manifests)."""
        return asdict(self)


@dataclass(frozen=True)
class Problem:
    """One problem: its numbers, its operators (one fewer), and the answer."""

    numbers: tuple[int, ...]
    operators: tuple[str, ...]
    answer: int

    @property
    def expression(self) -> str:
        """The bare expression, e.g. ``"23+14-5"``."""
        parts = [str(self.numbers[0])]
        for op, number in zip(self.operators, self.numbers[1:], strict=True):
            parts.append(op + str(number))
        return "".join(parts)


def draw_problem(rng: random.Random, config: ArithmeticConfig) -> Problem:
    """Draw one problem with ``rng`` (see :class:`ArithmeticConfig` for the distribution)."""
    high = 10**config.digits - 1
    numbers = [rng.randint(0, high)]
    operators: list[str] = []
    total = numbers[0]
    for _ in range(config.operands - 1):
        op = rng.choice(config.operations)
        if op == "-" and not config.allow_negative:
            number = rng.randint(0, min(high, total))
            total -= number
        else:
            number = rng.randint(0, high)
            total = total + number if op == "+" else total - number
        numbers.append(number)
        operators.append(op)
    return Problem(tuple(numbers), tuple(operators), total)


def render_prompt(problem: Problem, style: str, rng: random.Random) -> str:
    """The prompt text for ``problem`` in ``style``; ``rng`` picks the name and item of a word problem."""
    if style == "expr":
        return problem.expression + "="
    if style != "word":
        raise ValueError(f"style: expected 'word' or 'expr', got {style!r}")
    name = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    clauses = [f"{name} has {problem.numbers[0]} {item}"]
    for op, number in zip(problem.operators, problem.numbers[1:], strict=True):
        clauses.append(f"{_WORD_FOR_OP[op]} {number}")
    return ", ".join(clauses) + ". Now? "


def make_row(problem: Problem, prompt: str, split: str, index: int) -> dict[str, Any]:
    """One verl-schema row (see the module docstring)."""
    answer = str(problem.answer)
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "data_source": DATA_SOURCE,
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "expression": problem.expression, "answer": answer},
    }


def count_distinct_problems(config: ArithmeticConfig) -> int | None:
    """Exact number of distinct expressions for two-operand configs without negatives; None otherwise."""
    if config.operands != 2 or config.allow_negative:
        return None
    size = 10**config.digits
    count = 0
    if "+" in config.operations:
        count += size * size
    if "-" in config.operations:
        count += size * (size + 1) // 2
    return count


def generate_splits(
    num_train: int,
    num_test: int,
    seed: int = 0,
    config: ArithmeticConfig | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Seeded train and held-out test rows whose expressions do not overlap.

    The test split is drawn first (distinct expressions), then the train split
    from the remaining expressions (distinct among themselves too). The same
    ``(num_train, num_test, seed, config)`` always gives the same rows.
    Raises ValueError when the task has fewer distinct problems than requested.
    """
    config = config or ArithmeticConfig()
    if num_train < 0 or num_test < 0:
        raise ValueError(f"num_train/num_test: expected >= 0, got {num_train}/{num_test}")
    available = count_distinct_problems(config)
    wanted = num_train + num_test
    if available is not None and wanted > 0.9 * available:
        raise ValueError(
            f"num_train+num_test: {wanted} requested but the task with {config} has only {available} "
            "distinct problems; ask for at most 90% of them, or raise digits/operands"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[dict[str, Any]]] = {"test": [], "train": []}
    for split, count in (("test", num_test), ("train", num_train)):
        attempts = 0
        while len(splits[split]) < count:
            attempts += 1
            if attempts > 50 * count + 1000:
                raise ValueError(f"num_{split}: could not draw {count} distinct problems with {config}")
            problem = draw_problem(rng, config)
            if problem.expression in seen:
                continue
            seen.add(problem.expression)
            prompt = render_prompt(problem, config.style, rng)
            splits[split].append(make_row(problem, prompt, split, len(splits[split])))
    return splits["train"], splits["test"]


def extract_answer(response_text: str) -> str | None:
    """The integer the response starts with, as text, or None.

    The response is cut at the first EOS marker (``<eos>`` and common chat
    end-of-turn tokens) and at the first newline, stripped of surrounding
    spaces, and must then be exactly one integer (e.g. ``"37"``, ``"-4"``).
    """
    text = response_text
    for marker in _EOS_MARKERS:
        text = text.split(marker, 1)[0]
    text = text.split("\n", 1)[0].strip()
    return text if _LEADING_INT.fullmatch(text) else None


def score(response_text: str, ground_truth: str | int) -> float:
    """1.0 when the response's answer (see :func:`extract_answer`) equals ``ground_truth`` as an integer, else 0.0."""
    answer = extract_answer(response_text)
    if answer is None:
        return 0.0
    try:
        expected = int(str(ground_truth).strip())
    except ValueError as error:
        raise ValueError(f"ground_truth: expected an integer, got {ground_truth!r}") from error
    return 1.0 if int(answer) == expected else 0.0


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write verl-schema rows to a parquet file (parent folders created); returns the path."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def read_parquet_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read a verl-schema parquet file back into plain Python rows (lists and dicts, not numpy arrays)."""
    import pyarrow.parquet as pq

    return pq.read_table(str(path)).to_pylist()


def write_splits(
    out_dir: str | Path,
    num_train: int = 5000,
    num_test: int = 500,
    seed: int = 0,
    config: ArithmeticConfig | None = None,
) -> dict[str, Path]:
    """Generate both splits and write ``train.parquet`` and ``test.parquet`` under ``out_dir``."""
    train_rows, test_rows = generate_splits(num_train, num_test, seed, config)
    out_dir = Path(out_dir)
    return {
        "train": write_parquet(train_rows, out_dir / "train.parquet"),
        "test": write_parquet(test_rows, out_dir / "test.parquet"),
    }


def generate(n: int, seed: int = 0, split: str = "train", **difficulty: Any) -> list[dict[str, Any]]:
    """``n`` rows of one split; ``difficulty`` fills :class:`ArithmeticConfig`.

    ``split="test"`` gives the same rows as ``generate_splits(0, n, seed)[1]``;
    any other split the same as ``generate_splits(n, 0, seed)[0]`` (relabelled).
    Rows of two calls may share expressions; use :func:`generate_splits` for
    disjoint train/test splits.
    """
    config = ArithmeticConfig(**difficulty)
    if split == "test":
        return generate_splits(0, n, seed, config)[1]
    rows = generate_splits(n, 0, seed, config)[0]
    for row in rows:
        row["extra_info"]["split"] = split
    return rows
