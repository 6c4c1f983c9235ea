"""verity's toy world: synthetic tasks, tiny models, a character tokenizer and the embedded presets.

A verity plug-in (:func:`verity_toyworld.plugin.register`); the runtime reaches it only
through :mod:`verity.data.task_registry` and :mod:`verity.data.embedded`.
"""
