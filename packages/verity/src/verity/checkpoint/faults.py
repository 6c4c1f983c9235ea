"""Fault injection for testing recovery: kill or stall a run at a chosen point.

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

Unset (the default), every hook is a cheap no-op.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

CRASH_ENV = "VERITY_DEBUG_CRASH_AT"
STALL_ENV = "VERITY_DEBUG_STALL"
CRASH_POINTS = ("step_end", "save")

_calls: Counter[str] = Counter()


def parse_crash_at(value: str) -> tuple[str, int]:
    """``"save:4"`` -> ``("save", 4)``; ValueError naming the variable for anything else."""
    point, _, step = value.partition(":")
    if point not in CRASH_POINTS or not step.isdigit():
        raise ValueError(f"{CRASH_ENV}={value!r}: expected <point>:<step> with point in {list(CRASH_POINTS)}")
    return point, int(step)


def maybe_crash(point: str, step: int) -> None:
    """SIGKILL this process if ``VERITY_DEBUG_CRASH_AT`` names ``point`` and ``step``."""
    value = os.environ.get(CRASH_ENV)
    if not value:
        return
    if parse_crash_at(value) == (point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def parse_stall(value: str) -> tuple[str, int, float]:
    """``"update_actor:3:60"`` -> ``("update_actor", 3, 60.0)``."""
    parts = value.split(":")
    try:
        method, call, seconds = parts[0], int(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        raise ValueError(f"{STALL_ENV}={value!r}: expected <method>:<call>:<seconds>") from None
    return method, call, seconds


def maybe_stall(method: str) -> None:
    """Count this call of ``method``; sleep if ``VERITY_DEBUG_STALL`` names this call."""
    value = os.environ.get(STALL_ENV)
    if not value:
        return
    _calls[method] += 1
    name, call, seconds = parse_stall(value)
    if name == method and _calls[method] == call:
        time.sleep(seconds)
