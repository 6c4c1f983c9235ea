"""A time limit on every stage of an RL step, and a report of who is still busy when it is hit.

    guard = StageGuard(timeout_s=600, groups={"actor": actor_group})
    with guard.stage("generate", step=12):
        batch = ctx.actor.generate(rows)

When a stage runs longer than ``timeout_s`` the guard's watchdog thread (one for the guard's
life, told of each stage's deadline) interrupts the driver's
main thread (``_thread.interrupt_main`` with a signal of its own, SIGUSR2, so that Ctrl-C
keeps its meaning; Ray's blocking waits return to Python to take it), and the stage raises :class:`StageTimeoutError` naming the stage, the step, the
worker ranks still running a group method (with how long and their Python stacks,
fetched through each worker's diagnostics concurrency group) and the driver's own stack.
A run that hangs in a collective, a deadlocked reward function or a stuck generation
therefore ends with a message saying where, instead of hanging forever. (A run driven
from another thread cannot be interrupted that way: there the error is raised when the
overrunning stage returns.)
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from types import TracebackType
from typing import Any

STACK_TIMEOUT_S = 10.0
#: seconds the watchdog thread waits with nothing to watch before it ends (a guard no longer used)
WATCHDOG_IDLE_EXIT_S = 30.0
WATCHDOG_SIGNAL = signal.SIGUSR2


class StageInterrupt(KeyboardInterrupt):
    """Raised in the driver's main thread when the watchdog fires (becomes StageTimeoutError)."""


def _raise_stage_interrupt(signum: int, frame: Any) -> None:
    raise StageInterrupt()


class StageTimeoutError(RuntimeError):
    """A stage ran past its time limit.

    Attributes: ``stage``, ``step``, ``timeout_s``, ``busy`` (a list of
    ``(group, rank, method, seconds)`` of the workers still running a method).
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        step: int | None,
        timeout_s: float,
        busy: list[tuple[str, int, str, float]],
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.step = step
        self.timeout_s = timeout_s
        self.busy = busy


class _Watchdog:
    """One daemon thread that fires each watched stage whose deadline passes (:meth:`_StageWatch._fire`).

    Starting and stopping a watch is a dictionary update under a lock; a thread per stage
    (``threading.Timer``) cost the driver more time, five times a step
    (``ci/reports/2026-12-06-docstring-figures.md``).
    """

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._deadlines: dict[_StageWatch, float] = {}  # watch -> time.monotonic() deadline
        self._thread: threading.Thread | None = None

    def watch(self, stage: _StageWatch, deadline: float) -> None:
        """Fire ``stage`` at ``deadline`` (``time.monotonic()`` seconds) unless :meth:`unwatch` comes first."""
        with self._wake:
            self._deadlines[stage] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="verity-stage-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()

    def unwatch(self, stage: _StageWatch) -> None:
        """Stop watching ``stage`` (nothing if it was not watched or has fired)."""
        with self._wake:
            self._deadlines.pop(stage, None)

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._deadlines:
                    self._wake.wait(WATCHDOG_IDLE_EXIT_S)
                    if not self._deadlines:  # nothing watched for a while: the next watch starts a thread
                        self._thread = None
                        return
                    continue
                now = time.monotonic()
                due = [stage for stage, deadline in self._deadlines.items() if deadline <= now]
                for stage in due:
                    del self._deadlines[stage]
                if not due:
                    self._wake.wait(min(self._deadlines.values()) - now)
                    continue
            for stage in due:  # outside the lock: firing takes the stage's own lock and may interrupt
                stage._fire()


class _StageWatch:
    """One stage under watch (the context manager returned by :meth:`StageGuard.stage`)."""

    def __init__(self, guard: StageGuard, name: str, step: int | None) -> None:
        self.guard, self.name, self.step = guard, name, step
        self._lock = threading.Lock()
        self._active = False
        self._fired = False
        self._driver_stack = ""
        self._thread_id = 0
        self._interruptible = True
        self._previous_handler: Any = None

    def _fire(self) -> None:
        with self._lock:
            if not self._active:
                return
            self._fired = True
            frame = sys._current_frames().get(self._thread_id)
            self._driver_stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        if self._interruptible:
            _thread.interrupt_main(WATCHDOG_SIGNAL)

    def __enter__(self) -> _StageWatch:
        if self.guard.timeout_s > 0:
            self._thread_id = threading.get_ident()
            # only the main thread can be interrupted; elsewhere the overrun is reported when the stage ends
            self._interruptible = threading.current_thread() is threading.main_thread()
            if self._interruptible:
                self._previous_handler = signal.signal(WATCHDOG_SIGNAL, _raise_stage_interrupt)
            self._active = True
            self.guard._watchdog.watch(self, time.monotonic() + self.guard.timeout_s)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self.guard.timeout_s <= 0:  # nothing was watched
            return False
        fired = False
        try:
            with self._lock:
                self._active = False
                fired = self._fired
            self.guard._watchdog.unwatch(self)
            if fired and self._interruptible and exc_type is not StageInterrupt:
                # the interrupt was sent but has not landed yet: let it land here, not later
                for _ in range(200):
                    time.sleep(0.005)
        except StageInterrupt:
            fired = True
        finally:
            if self._interruptible:
                signal.signal(WATCHDOG_SIGNAL, self._previous_handler or signal.SIG_DFL)
        if fired:
            cause = None if isinstance(exc, StageInterrupt) else exc
            raise self.guard.timeout_error(self.name, self.step, self._driver_stack) from cause
        return False


class StageGuard:
    """Watches stages against ``timeout_s`` (0 or less: no limit).

    Args:
        timeout_s: the limit for each stage, in seconds.
        groups: name -> worker group (with ``stacks(timeout_s)``) to report on when a
            stage times out.
    """

    def __init__(self, timeout_s: float, groups: Mapping[str, Any] | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.groups = dict(groups or {})
        self._watchdog = _Watchdog()

    def stage(self, name: str, step: int | None = None) -> _StageWatch:
        """A context manager that raises :class:`StageTimeoutError` if its body outlives the limit."""
        return _StageWatch(self, name, step)

    def timeout_error(self, stage: str, step: int | None, driver_stack: str = "") -> StageTimeoutError:
        """Build the error: busy workers (asked for their stacks now) and the driver's stack."""
        busy: list[tuple[str, int, str, float]] = []
        sections: list[str] = []
        for group_name, group in self.groups.items():
            try:
                answers = group.stacks(timeout_s=STACK_TIMEOUT_S)
            except Exception as err:  # the report must not hide the timeout
                sections.append(f"--- {group_name}: could not ask for stacks ({type(err).__name__}: {err})")
                continue
            for rank, answer in sorted(answers.items()):
                if answer is None:
                    busy.append((group_name, rank, "?", float("nan")))
                    sections.append(f"--- {group_name} rank {rank}: no answer within {STACK_TIMEOUT_S:g} s")
                    continue
                running = answer.get("busy")
                if running is None:
                    continue
                busy.append((group_name, rank, running["method"], float(running["seconds"])))
                role = running["role"]
                method = running["method"] if role == "worker" else f"{role}.{running['method']}"
                sections.append(
                    f"--- {group_name} rank {rank} (pid {answer.get('pid')}): {method} "
                    f"running for {running['seconds']:.1f} s\n{running['stack'].rstrip()}"
                )
        where = f" at step {step}" if step is not None else ""
        if busy:
            who = ", ".join(f"{g} rank {r} ({m})" for g, r, m, _ in busy)
        else:
            who = "none (the driver itself was busy)"
        message = (
            f"stage {stage!r}{where} exceeded trainer.stage_timeout_s = {self.timeout_s:g} s; "
            f"workers still busy: {who}"
        )
        if sections:
            message += "\n" + "\n".join(sections)
        if driver_stack:
            message += f"\n--- driver (main thread)\n{driver_stack.rstrip()}"
        return StageTimeoutError(message, stage=stage, step=step, timeout_s=self.timeout_s, busy=busy)
