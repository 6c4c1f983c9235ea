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


def cut_response(text: str) -> str:
    """The response up to its first end-of-sequence marker."""
    for marker in EOS_MARKERS:
        text = text.split(marker, 1)[0]
    return text
