"""Fault injection for recovery tests: kill or stall a run at a chosen point.

Read from environment variables (never from the run config, so a resumed run has
the same config hash as the one that crashed):

``VERITY_DEBUG_CRASH_AT=<point>:<step>``
    the driver kills itself with SIGKILL (no cleanup, like the OOM killer or a lost
    node) at ``point`` of RL step ``step``:

    - ``step_end``: after the step's metrics are logged and its checkpoint (if any)
      is committed, before the next step starts;
    - ``save``: in the middle of saving the step's checkpoint (worker shards written,
      driver state not yet written, folder not yet renamed).

``VERITY_DEBUG_STALL=<method>:<call>:<seconds>``
    a worker sleeps ``seconds`` at the start of the ``call``-th (1-based) call of its
    group method ``method`` (e.g. ``update_actor:3:60``): a hung collective or a slow
    stage, on demand.

Both variables are read once, when this module is imported (the driver and every worker
process import it before their first step). Unset (the default), :data:`CRASH` and
:data:`STALL` are None and each hook returns after one ``is None`` test: nothing is read,
parsed or counted on the hot path. A malformed value raises ``ValueError`` with one sentence
naming the variable, at import, so a planted run stops before any compute starts.
"""

from __future__ import annotations

import os
import signal
import time

CRASH_ENV = "VERITY_DEBUG_CRASH_AT"
STALL_ENV = "VERITY_DEBUG_STALL"
CRASH_POINTS = ("step_end", "save")


def parse_crash_at(value: str) -> tuple[str, int]:
    """``"save:4"`` -> ``("save", 4)``; ValueError naming the variable for anything else."""
    point, _, step = value.partition(":")
    if point not in CRASH_POINTS or not step.isdigit():
        raise ValueError(f"{CRASH_ENV}={value!r}: expected <point>:<step> with point in {list(CRASH_POINTS)}")
    return point, int(step)


def parse_stall(value: str) -> tuple[str, int, float]:
    """``"update_actor:3:60"`` -> ``("update_actor", 3, 60.0)`` (method, 1-based call, seconds)."""
    parts = value.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        method, call, seconds = parts[0], int(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError(f"{STALL_ENV}={value!r}: expected <method>:<call>:<seconds>") from None
    return method, call, seconds


# What this process was asked for; None when the variable is unset or empty.
CRASH: tuple[str, int] | None = parse_crash_at(os.environ[CRASH_ENV]) if os.environ.get(CRASH_ENV) else None
STALL: tuple[str, int, float] | None = (
    parse_stall(os.environ[STALL_ENV]) if os.environ.get(STALL_ENV) else None
)
_stall_calls = 0  # calls so far of the method STALL names, in this process


def maybe_crash(point: str, step: int) -> None:
    """SIGKILL this process if ``VERITY_DEBUG_CRASH_AT`` named ``point`` and ``step``."""
    if CRASH is None:
        return
    if (point, step) == CRASH:
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_stall(method: str) -> None:
    """Sleep if ``VERITY_DEBUG_STALL`` named this call of ``method`` (calls counted per process)."""
    global _stall_calls
    if STALL is None or STALL[0] != method:
        return
    _stall_calls += 1
    if _stall_calls == STALL[1]:
        time.sleep(STALL[2])
