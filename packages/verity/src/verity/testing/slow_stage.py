"""A planted slowdown of named stages, for tests and the nightly's planted regressions.

    VERITY_TEST_SLOW_STAGE=update_actor:0.10 verity train ...   # the update stage takes 10% longer

The variable holds ``stage:fraction`` pairs separated by commas. When a slowed stage ends,
:func:`slow_down` adds ``fraction`` x the seconds it took (slept, or spun on a given clock), so
the stage's time (and every figure built on it) grows by that fraction while its work stays
the same. The
trainer's :class:`verity.trainer.loop.StageTimer` calls it for every stage; the bench
(``ci/bench.py``) calls it around the engine's training step, the update measured outside a
trainer. The variable is read once, when this module is imported: with it unset
:data:`SLOWED` is empty and a call site costs one truth test of that dict.

A malformed value raises ``ValueError`` with one sentence naming the variable, at import, so
a planted run stops before any compute starts instead of silently running unslowed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

ENV_VAR = "VERITY_TEST_SLOW_STAGE"


def parse_slowdowns(text: str) -> dict[str, float]:
    """``"update_actor:0.1,generate:0.5"`` -> ``{"update_actor": 0.1, "generate": 0.5}``; ``""`` -> ``{}``.

    Raises ValueError naming the bad entry: each must be ``stage:fraction`` with a fraction > 0.
    """
    slowed: dict[str, float] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        stage, sep, fraction = entry.partition(":")
        try:
            value = float(fraction) if sep and stage.strip() else float("nan")
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(
                f"{ENV_VAR}: {entry!r} is not stage:fraction with a fraction > 0 (e.g. update_actor:0.10)"
            )
        slowed[stage.strip()] = value
    return slowed


SLOWED: dict[str, float] = parse_slowdowns(os.environ.get(ENV_VAR, ""))


def slow_down(stage: str, seconds: float, clock: Callable[[], float] | None = None) -> float:
    """Stretch a slowed ``stage`` that just took ``seconds`` by ``SLOWED[stage]``; the seconds added (0.0 if not slowed).

    Without ``clock`` the added time is slept (wall clock: the trainer's stage timer). With a
    ``clock`` (e.g. :func:`time.process_time`, for a figure timed in CPU seconds) it is spent
    spinning until that clock has advanced by it, as slower code would spend it.
    """
    fraction = SLOWED.get(stage)
    if fraction is None or seconds <= 0:
        return 0.0
    extra = seconds * fraction
    if clock is None:
        time.sleep(extra)
        return extra
    until = clock() + extra
    while clock() < until:
        pass
    return extra
