"""The plug-in entry point: the toy world's tasks and embedded presets join the runtime's registries."""

from __future__ import annotations


def register() -> None:
    """Register the synthetic tasks, the SFT teachers and the embedded presets (importing registers them)."""
    import verity_toyworld.presets  # noqa: F401  (teachers, then the presets, into verity.data.embedded)
    import verity_toyworld.tasks  # noqa: F401  (each task into verity.data.task_registry)
