"""The toy world's synthetic verifiable tasks, by name.

Each task module provides ``DATA_SOURCE`` (the verl ``data_source`` of its
rows), ``generate_splits(num_train, num_test, seed, config) -> (train_rows,
test_rows)``, its knob dataclass ``*Config`` and the verifier ``score(response_text,
ground_truth) -> float``. :func:`register` adds them to the runtime's task registry
(:mod:`verity.data.task_registry`), where rewards and ``verity data synth`` find them.
"""

from __future__ import annotations

from types import ModuleType

from verity.data.task_registry import TASKS as RUNTIME_TASKS
from verity.data.task_registry import register_task
from verity.data.task_registry import task_for_data_source as task_for_data_source

from verity_toyworld.tasks import arithmetic, countdown, digit_sequence, gsm8k_style, multiply, shape_count

TASKS: dict[str, ModuleType] = {
    "arithmetic": arithmetic,
    "gsm8k_style": gsm8k_style,
    "countdown": countdown,
    "digit_sequence": digit_sequence,
    "multiply": multiply,
    "shape_count": shape_count,  # visual: rows carry images (verity.data.multimodal)
}


def register() -> None:
    """Add each task to the runtime's task registry (once; a later call does nothing)."""
    for name, module in TASKS.items():
        if name not in RUNTIME_TASKS:
            register_task(name, module)


register()
