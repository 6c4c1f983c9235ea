"""When one rank of a group call fails, find out which ranks are dead before reporting.

A rank that dies in the middle of a collective (killed, out of memory, segfault)
is usually *not* the first failure the driver sees: its peers' collective call
fails at once with ``Connection reset by peer`` (gloo) or a NCCL error, while Ray
takes a moment to notice that the process is gone. Reporting the first error
would send the user to the survivors, which only reacted to the death.

:func:`explain_failure` is called with the first failure of a call. It asks every
rank of the group whether its process lives (a trivial call on each rank's
diagnostics concurrency group, which answers even while a method runs), waits up
to ``grace_s`` for those answers and for the call's other ranks, and builds the
error to raise:

- any rank dead -> :class:`~verity.controller.WorkerDiedError` naming every dead
  rank as the cause and the other ranks' errors as consequences;
- no rank dead -> the first error, as :class:`WorkerMethodError` (the method
  raised) or :class:`WorkerError` (anything else Ray reported).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verity.controller.errors import WorkerDiedError, WorkerError, WorkerMethodError

DEFAULT_GRACE_S = 20.0


def _short(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def _classify(ref: Any) -> tuple[str, BaseException | None]:
    """``("ok", None)``, ``("dead", error)`` or ``("error", error)`` for a finished ref."""
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(ref)
    except RayActorError as err:
        return "dead", err
    except Exception as err:  # a method error, or another Ray error
        return "error", err
    return "ok", None


def explain_failure(
    *,
    label: str,
    where: Mapping[str, str],
    rank: int,
    error: BaseException,
    pending: Sequence[Any],
    rank_of: Mapping[Any, int],
    ping: Callable[[int], Any],
    world_size: int,
    grace_s: float = DEFAULT_GRACE_S,
    node_of: Callable[[int], str] | None = None,
) -> WorkerError:
    """The error to raise for a group call whose rank ``rank`` failed with ``error``.

    Args:
        label: ``group.method`` (or ``group/role.method``) for messages.
        where: ``group``, ``role`` and ``method`` keyword arguments of the error.
        rank: the rank whose failure arrived first; ``error``: what Ray raised for it.
        pending: the call's refs not yet finished; ``rank_of`` maps each ref to its rank.
        ping: ``ping(rank)`` submits a liveness check on that rank and returns its ref.
        world_size: ranks in the group (every one is checked, not only the called ones).
        grace_s: seconds to wait for the liveness answers.
        node_of: ``node_of(rank)`` names the node a rank ran on (said of each dead rank).
    """
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    dead: dict[int, BaseException] = {}
    errors: dict[int, BaseException] = {}
    (dead if isinstance(error, RayActorError) else errors)[rank] = error
    pings = {}
    for r in range(world_size):
        if r == rank and r in dead:
            continue
        try:
            pings[ping(r)] = r
        except Exception as err:  # a handle Ray already knows is dead
            dead[r] = err
    waiting = list(pings) + list(pending)
    unanswered = set(pings)
    deadline = time.monotonic() + grace_s
    while unanswered and waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=left)
        if not ready:
            break
        ref = ready[0]
        status, err = _classify(ref)
        r = pings.get(ref, rank_of.get(ref))
        unanswered.discard(ref)
        if r is None or err is None:
            continue
        if status == "dead":
            dead[r] = err
            errors.pop(r, None)
        elif r not in dead and ref not in pings:
            errors.setdefault(r, err)
    silent = sorted(pings[ref] for ref in unanswered if pings[ref] not in dead)
    if dead:
        first = min(dead)
        on = (lambda r: f" on {node_of(r)}") if node_of is not None else (lambda r: "")
        names = ", ".join(f"rank {r} died{on(r)} ({_short(e)})" for r, e in sorted(dead.items()))
        message = f"{label}: the worker process of {names}"
        consequences = {r: e for r, e in errors.items() if r not in dead}
        if consequences:
            shown = "; ".join(f"rank {r}: {_short(e)}" for r, e in sorted(consequences.items()))
            message += f". The errors of the other ranks followed from that death: {shown}"
        if silent:
            message += f". Rank(s) {silent} did not answer a liveness check within {grace_s:g} s"
        return WorkerDiedError(message, rank=first, cause=dead[first], **where)
    if isinstance(error, RayTaskError):
        cause = getattr(error, "cause", None) or error
        return WorkerMethodError(
            f"{label} failed on rank {rank}: {type(cause).__name__}: {cause}\n--- worker traceback ---\n{error}",
            rank=rank,
            cause=cause,
            **where,
        )
    return WorkerError(f"{label} failed on rank {rank}: {error}", rank=rank, cause=error, **where)
