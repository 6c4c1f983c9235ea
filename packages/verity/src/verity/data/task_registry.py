"""Synthetic verifiable tasks by name: the seam through which a package adds generated tasks.

A task is a module (or any object) with ``DATA_SOURCE`` (the verl ``data_source`` of its
rows), ``generate_splits(num_train, num_test, seed, config) -> (train_rows, test_rows)``,
one knob dataclass named ``*Config`` and the verifier ``score(response_text, ground_truth) ->
float`` in [0, 1]. The runtime ships none: a plug-in registers them (``verity-toyworld``
registers ``arithmetic``, ``countdown``, ... when loaded). Rows of a registered task's
``data_source`` are scored by its ``score`` (reward spec ``task:<name>``), and
``verity data synth --task NAME`` writes its splits.
"""

from __future__ import annotations

from typing import Any

from verity.registry import Registry

TASKS: Registry[Any] = Registry("synthetic task")


def register_task(name: str, task: Any) -> None:
    """Make ``task`` (see the module docstring for what it provides) available as ``name``."""
    for attribute in ("DATA_SOURCE", "generate_splits", "score"):
        if not hasattr(task, attribute):
            raise TypeError(f"synthetic task {name!r}: {task!r} has no {attribute!r}")
    TASKS.add(name, task)


def synthetic_tasks() -> Registry[Any]:
    """The task registry with every plug-in loaded (so a task a plug-in registers is found in any process)."""
    from verity.plugins import load_plugins

    load_plugins()
    return TASKS


def task_for_data_source(data_source: str) -> Any:
    """The task whose ``DATA_SOURCE`` equals ``data_source``; KeyError naming the known ones otherwise."""
    registry = synthetic_tasks()
    for _, task in registry.items():
        if data_source == task.DATA_SOURCE:
            return task
    known = sorted(task.DATA_SOURCE for _, task in registry.items())
    raise KeyError(f"data_source: no synthetic task for {data_source!r}; known: {known}")


def task_config_class(task: Any) -> type:
    """The task's knob dataclass (by convention its one class named ``*Config``)."""
    name = getattr(task, "__name__", type(task).__name__)
    classes = [
        value
        for key, value in vars(task).items()
        if key.endswith("Config") and isinstance(value, type) and value.__module__ == name
    ]
    if len(classes) != 1:
        raise ValueError(f"task: {name} should define exactly one *Config class, found {classes}")
    return classes[0]
