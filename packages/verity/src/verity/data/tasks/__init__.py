"""Synthetic verifiable tasks, by name.

Each task module provides ``DATA_SOURCE`` (the verl ``data_source`` of its
rows), ``generate_splits(num_train, num_test, seed, config) -> (train_rows,
test_rows)`` and the verifier ``score(response_text, ground_truth) -> float``.
"""

from __future__ import annotations

from types import ModuleType

from verity.data.tasks import arithmetic, countdown, digit_sequence, gsm8k_style, multiply, shape_count

TASKS: dict[str, ModuleType] = {
    "arithmetic": arithmetic,
    "gsm8k_style": gsm8k_style,
    "countdown": countdown,
    "digit_sequence": digit_sequence,
    "multiply": multiply,
    "shape_count": shape_count,  # visual: rows carry images (verity.data.multimodal)
}


def task_for_data_source(data_source: str) -> ModuleType:
    """The task module whose ``DATA_SOURCE`` equals ``data_source``; KeyError naming the known ones otherwise."""
    for module in TASKS.values():
        if data_source == module.DATA_SOURCE:
            return module
    known = sorted(module.DATA_SOURCE for module in TASKS.values())
    raise KeyError(f"data_source: no synthetic task for {data_source!r}; known: {known}")
