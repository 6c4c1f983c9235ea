"""Errors a run stops on with one sentence and an exit code, for plug-ins as for the runtime.

    from verity.errors import RunError

    class TooFewSignals(RunError):  # a plug-in's own error
        exit_code = 1

    raise TooFewSignals("dynamic sampling, step 3: ...; raise mine.max_rounds or change the data")

``verity train`` prints ``verity train: <message>`` and exits with the error's
``exit_code`` — no traceback; with the last complete checkpoint named when there is
one. A :class:`RunError` raised in a worker (a plug-in role's method) is reported the
same way.
"""

from __future__ import annotations

__all__ = ["RunError"]


class RunError(RuntimeError):
    """A failure the user should read as one sentence: what happened and what to change.

    ``exit_code``: what ``verity train`` exits with (1 by default, as for a run that failed
    while training; 2 for bad input found before training, see docs/failures.md). A
    subclass may set it as a class attribute; ``RunError(message, exit_code=2)`` sets it
    for one error.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
