"""Shared pieces of the synthetic tasks: verl rows, distinct draws, train/test splits, answer cutting."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

EOS_MARKERS = ("<eos>", "<|im_end|>", "<|endoftext|>", "</s>")

# A draw returns (key, prompt, ground_truth, extra_info); the key deduplicates problems.
Draw = Callable[[random.Random], tuple[str, str, str, dict[str, Any]]]


def make_row(
    data_source: str,
    ability: str,
    prompt: str,
    ground_truth: str,
    split: str,
    index: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One verl-schema row with a single user message."""
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "data_source": data_source,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def draw_rows(
    draw: Draw,
    counts: dict[str, int],
    seed: int,
    data_source: str,
    ability: str,
    max_attempts_per_row: int = 50,
) -> dict[str, list[dict[str, Any]]]:
    """Rows for each split in ``counts`` (drawn in that order) with no problem key shared by two rows.

    Raises ValueError when the task cannot produce that many distinct problems.
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    out: dict[str, list[dict[str, Any]]] = {}
    for split, count in counts.items():
        if count < 0:
            raise ValueError(f"num_{split}: expected >= 0, got {count}")
        rows: list[dict[str, Any]] = []
        attempts = 0
        while len(rows) < count:
            attempts += 1
            if attempts > max_attempts_per_row * count + 1000:
                raise ValueError(
                    f"{data_source}: could not draw {count} distinct {split} problems; "
                    "ask for fewer or make the task harder (larger numbers, more steps)"
                )
            key, prompt, truth, extra = draw(rng)
            if key in seen:
                continue
            seen.add(key)
            rows.append(make_row(data_source, ability, prompt, truth, split, len(rows), extra))
        out[split] = rows
    return out


Rows = list[dict[str, Any]]


def task_generators(
    draw_problem: Callable[[random.Random, Any], tuple[str, str, str, dict[str, Any]]],
    config_class: type,
    data_source: str,
    ability: str,
) -> tuple[Callable[..., Rows], Callable[..., tuple[Rows, Rows]]]:
    """A task module's ``generate`` and ``generate_splits``, both built on :func:`draw_rows`.

    ``draw_problem(rng, config)`` draws one problem (see :data:`Draw`) for a
    ``config_class`` instance (the task's frozen difficulty dataclass). The two
    functions are named, documented and placed (``__module__``) as if the task
    module defined them; assign them there::

        generate, generate_splits = task_generators(draw_problem, MyConfig, DATA_SOURCE, ABILITY)

    - ``generate(n, seed=0, split="train", **difficulty) -> rows``: ``n`` rows
      labelled ``split``; ``difficulty`` fills ``config_class``.
    - ``generate_splits(num_train, num_test, seed=0, config=None) -> (train_rows,
      test_rows)``: the test split is drawn first, then the train split, from one
      seeded stream, with no problem key shared between or within them
      (``config=None``: the default ``config_class()``).
    """
    name = config_class.__name__

    def generate(n: int, seed: int = 0, split: str = "train", **difficulty: Any) -> Rows:
        config = config_class(**difficulty)
        return draw_rows(lambda rng: draw_problem(rng, config), {split: n}, seed, data_source, ability)[split]

    def generate_splits(
        num_train: int, num_test: int, seed: int = 0, config: Any = None
    ) -> tuple[Rows, Rows]:
        config = config or config_class()
        splits = draw_rows(
            lambda rng: draw_problem(rng, config),
            {"test": num_test, "train": num_train},
            seed,
            data_source,
            ability,
        )
        return splits["train"], splits["test"]

    generate.__doc__ = f"``n`` distinct seeded problems as verl rows; ``difficulty`` fills :class:`{name}`."
    generate_splits.__doc__ = (
        f"Seeded train and test rows that share no problem (the test split is drawn first); "
        f"``config``: a :class:`{name}` (None: its defaults)."
    )
    for function in (generate, generate_splits):
        function.__module__ = draw_problem.__module__
        function.__qualname__ = function.__name__
    return generate, generate_splits


def cut_response(text: str) -> str:
    """The response up to its first end-of-sequence marker."""
    for marker in EOS_MARKERS:
        text = text.split(marker, 1)[0]
    return text
