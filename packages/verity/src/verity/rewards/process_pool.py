"""A process pool whose tasks each have a deadline, and whose hung workers are killed and replaced.

``concurrent.futures.ProcessPoolExecutor`` cannot stop one running task: a
verifier stuck in an infinite loop holds its worker forever, and a worker that
dies breaks the whole executor. :class:`TimeoutPool` keeps one task in flight
per worker, waits on all workers' pipes at once, and

- at a task's deadline SIGKILLs its worker, records ``"timeout"`` and starts a fresh worker;
- when a worker dies mid-task (segfault, ``os._exit``, out of memory) records ``"error"``
  and starts a fresh worker;
- when the task raises, records ``"error"`` with the traceback (the worker lives on).

Hung tasks time out in parallel, not one after another: a task still running after
``stall_s`` (default: a quarter of its timeout, at most 1 s) no longer holds the queue —
the pool widens to ``max_workers`` processes for the rest of the call, so the tasks
behind it start at once, and the extra workers are stopped when the call ends. With
``H`` hung tasks a call therefore takes about ``stall_s + ceil(H / max_workers) *
timeout`` beyond the honest work, instead of ``H * timeout / num_workers``.
Tasks are a picklable module-level function plus picklable arguments. The pool can be
used from any thread of the driver or of a Ray actor; calls to :meth:`map` are
serialised by a lock.

Besides the blocking :meth:`TimeoutPool.map`, tasks can be started one by one without
waiting (:meth:`TimeoutPool.submit`, which returns a ticket) and their outcomes picked up
as they finish (:meth:`TimeoutPool.collect`); the agent loop does this so a tool call
runs while the model writes. Such tasks keep the same deadlines and replacements but
never widen the pool: a submitted task waits for one of the ``num_workers`` workers. The
two ways are not mixed: :meth:`map` refuses to run while submitted tasks are unfinished.

Start-up is never charged to a task: a worker takes tasks only once it has started and
run its warm-up steps (``initializer`` and every :meth:`TimeoutPool.warm_up` step, e.g.
loading the reward functions it will run), which together are bounded by
``startup_timeout_s`` (seconds, default 120) instead of a task's timeout. A worker that
cannot start in that time is replaced; when starts keep failing the pool raises
RuntimeError naming the step it was running.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any


@dataclass
class TaskOutcome:
    """What happened to one task: ``status`` is ``"ok"``, ``"timeout"`` or ``"error"``."""

    status: str
    value: Any = None
    error: str | None = None
    elapsed_s: float = 0.0


WarmStep = tuple[Callable[..., Any], tuple]
"""``(func, args)`` a worker runs before it takes tasks; its time is start-up, not a task's."""


def _describe(step: WarmStep) -> str:
    """``func(args)`` of a warm-up step, shortened, for error messages."""
    func, args = step
    text = f"{getattr(func, '__qualname__', func)}{args!r}"
    return text if len(text) <= 200 else text[:197] + "..."


def _run_warm_step(step: WarmStep) -> None:
    with contextlib.suppress(Exception):  # a broken step shows up when the tasks that need it run
        step[0](*step[1])


def _worker_main(conn: Connection, warm_steps: Sequence[WarmStep] = ()) -> None:
    """Worker loop: run the warm-up steps, announce readiness, then receive messages:
    ``("task", func, args)``, answered ``("ok", value)`` or ``("error", traceback)``;
    ``("warm", func, args)``, a further warm-up step, answered ``("ready", pid)``; None: stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business
    for step in warm_steps:
        _run_warm_step(step)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            message = pickle.loads(data)
            if message is None:
                return
            kind, func, args = message
            if kind == "warm":
                _run_warm_step((func, args))
                conn.send(("ready", os.getpid()))
                continue
            reply: tuple[str, Any] = ("ok", func(*args))
        except BaseException as error:  # a task may raise anything, even SystemExit
            reply = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}")
        try:
            conn.send(reply)
        except Exception as error:  # e.g. an unpicklable return value
            conn.send(("error", f"result could not be sent back: {type(error).__name__}: {error}"))


_start_lock = threading.Lock()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Hide ``__main__``'s file and spec while starting a worker.

    ``spawn``/``forkserver`` children normally re-import the parent's main script (as
    ``__mp_main__``); a worker here needs nothing from it, and re-running a user's
    unguarded training script (or a Ray worker's entry module, or ``<stdin>``) in every
    reward worker would be wrong. Without a file or spec, the child skips that import.
    """
    main = sys.modules.get("__main__")
    with _start_lock:
        if main is None:
            yield
            return
        saved = {key: main.__dict__.pop(key) for key in ("__file__", "__spec__") if key in main.__dict__}
        main.__spec__ = None
        try:
            yield
        finally:
            if "__spec__" not in saved:
                del main.__spec__
            main.__dict__.update(saved)


class _Worker:
    def __init__(self, context: mp.context.BaseContext, warm_steps: Sequence[WarmStep] = ()) -> None:
        parent_conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(target=_worker_main, args=(child_conn, tuple(warm_steps)), daemon=True)
        with _main_module_hidden():
            self.process.start()
        child_conn.close()
        self.conn = parent_conn
        self.readies_owed = 1  # "ready" messages still to come: one for start-up, one per warm-up step sent
        self.warming = "starting" + (
            f" (last warm-up step: {_describe(warm_steps[-1])})" if warm_steps else ""
        )
        self.spawned = time.monotonic()  # when the current start-up or warm-up began
        self.task_index: int | None = None
        self.started = 0.0
        self.deadline = 0.0
        self.stall_at = 0.0

    @property
    def ready(self) -> bool:
        """Started and warmed up: it may take a task."""
        return self.readies_owed == 0

    def send_warm_step(self, step: WarmStep) -> None:
        """Have the worker run one more warm-up step; it is not ready until the step is done."""
        with contextlib.suppress(OSError):  # a dead worker shows up as a start-up failure
            self.conn.send(("warm", step[0], step[1]))
        if self.ready:
            self.spawned = time.monotonic()
        self.readies_owed += 1
        self.warming = f"running the warm-up step {_describe(step)}"

    def kill(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(None)
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()


class TimeoutPool:
    """``num_workers`` processes that run tasks with per-task deadlines.

    Args:
        num_workers: worker processes (>= 1).
        start_method: ``"forkserver"`` (default: safe from threaded parents such as
            Ray actors, and fast to restart a worker), ``"spawn"`` or ``"fork"``.
        preload: modules imported once by the fork server, so fresh workers start warm
            (forkserver only).
        on_worker_killed: called with the pid of every worker the pool kills at a
            deadline, after the kill (to clean up what the worker may have left behind).
        initializer: ``(func, args)`` each worker runs once before it takes tasks (e.g. to
            import a slow reward module); its time is not charged to any task. Further such
            steps can be added later with :meth:`warm_up`.
        max_workers: processes the pool may widen to while tasks stall (default:
            ``max(num_workers, 16)``); ``stall_s``: seconds after which a running task counts
            as stalled (default: ``min(1, timeout / 4)`` per task).
        startup_timeout_s: seconds a worker may take to start (with the warm-up steps known
            then), and to run each warm-up step added later (default 120; not charged to any task).
    """

    def __init__(
        self,
        num_workers: int,
        start_method: str = "forkserver",
        preload: Sequence[str] = (),
        on_worker_killed: Callable[[int], None] | None = None,
        initializer: tuple[Callable[..., Any], tuple] | None = None,
        max_workers: int | None = None,
        stall_s: float | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers: expected an int >= 1, got {num_workers!r}")
        max_workers = max(num_workers, 16) if max_workers is None else max_workers
        if not isinstance(max_workers, int) or max_workers < num_workers:
            raise ValueError(
                f"max_workers: expected an int >= num_workers ({num_workers}), got {max_workers!r}"
            )
        if stall_s is not None and not stall_s > 0:
            raise ValueError(f"stall_s: expected > 0 seconds, got {stall_s!r}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s: expected > 0 seconds, got {startup_timeout_s!r}")
        if start_method not in mp.get_all_start_methods():
            raise ValueError(
                f"start_method: {start_method!r} is not available here; choose from {mp.get_all_start_methods()}"
            )
        self._context = mp.get_context(start_method)
        if start_method == "forkserver" and preload:
            self._context.set_forkserver_preload(list(preload))
        self._num_workers = num_workers
        self._max_workers = max_workers
        self._stall_s = stall_s
        self._wide = False  # widened to max_workers because a task stalled (reset per map call)
        self.peak_workers = 0  # most worker processes alive at once (for tests and logs)
        self._on_worker_killed = on_worker_killed
        self._warm_steps: list[WarmStep] = [initializer] if initializer is not None else []
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.workers_replaced = 0
        self.startup_timeout_s = float(startup_timeout_s)
        self._startup_failures = 0
        self._next_ticket = 0
        self._submitted: dict[int, tuple[Callable[..., Any], tuple]] = {}  # ticket -> (func, args)
        self._submitted_timeouts: dict[int, float] = {}
        self._submitted_queue: deque[int] = deque()  # tickets not yet sent to a worker, in order
        self._submitted_done: dict[int, TaskOutcome] = {}

    @property
    def num_workers(self) -> int:
        """How many worker processes the pool keeps."""
        return self._num_workers

    def worker_pids(self) -> list[int]:
        """The pids of the live workers (starts them if not yet started)."""
        with self._lock:
            self._ensure_workers()
            return [w.process.pid for w in self._workers if w.process.pid is not None]

    def _ensure_workers(self) -> None:
        if self._closed:
            raise RuntimeError("TimeoutPool: used after close()")
        self._workers = [w for w in self._workers if w.process.is_alive()]
        while len(self._workers) < self._num_workers:
            self._workers.append(_Worker(self._context, self._warm_steps))
        self.peak_workers = max(self.peak_workers, len(self._workers))

    def warm_up(self, func: Callable[..., Any], args: tuple = ()) -> None:
        """Have every worker run ``func(*args)`` before its next task, and wait until all have.

        Workers started later (replacements, the extra workers of a stalled call) run it at
        start-up too. Its time counts against ``startup_timeout_s``, never against a task's
        timeout; an exception it raises is ignored here (the tasks that need what it loads
        meet the error themselves). RuntimeError naming the step when workers keep failing
        to finish it (see :meth:`map`'s start-up rules).
        """
        step = (func, tuple(args))
        with self._lock:
            self._ensure_workers()
            self._warm_steps.append(step)
            for worker in self._workers:
                worker.send_warm_step(step)
            while any(not w.ready for w in self._workers):
                self._wait_and_collect([], [])

    def _replace(self, worker: _Worker, killed: bool) -> _Worker:
        pid = worker.process.pid
        worker.kill()
        if killed and self._on_worker_killed is not None and pid is not None:
            with contextlib.suppress(Exception):  # cleanup must not break scoring
                self._on_worker_killed(pid)
        self.workers_replaced += 1
        fresh = _Worker(self._context, self._warm_steps)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def map(
        self,
        func: Callable[..., Any],
        args_list: Sequence[tuple],
        timeout_s: float | Sequence[float],
    ) -> list[TaskOutcome]:
        """Run ``func(*args)`` for every ``args`` in ``args_list``; one :class:`TaskOutcome` per task, in order.

        ``timeout_s``: seconds each task may run (one number, or one per task), counted
        from when it is sent to a worker that has started (a worker's own start-up,
        bounded by ``startup_timeout_s``, is not charged to any task).
        """
        timeouts = (
            [float(timeout_s)] * len(args_list) if isinstance(timeout_s, int | float) else list(timeout_s)
        )
        if len(timeouts) != len(args_list):
            raise ValueError(f"timeout_s: expected {len(args_list)} values, got {len(timeouts)}")
        if any(t <= 0 for t in timeouts):
            raise ValueError("timeout_s: every timeout must be > 0 seconds")
        outcomes: list[TaskOutcome | None] = [None] * len(args_list)
        with self._lock:
            if self._submitted:
                raise RuntimeError("TimeoutPool.map: submitted tasks are still unfinished (collect them first)")
            self._ensure_workers()
            self._wide = False
            pending = deque(range(len(args_list)))
            try:
                while pending or any(w.task_index is not None for w in self._workers):
                    self._widen_if_stalled(pending, timeouts)
                    for worker in self._workers:
                        if worker.ready and worker.task_index is None and pending:
                            index = pending.popleft()
                            worker.task_index = index
                            worker.started = time.monotonic()
                            worker.deadline = worker.started + timeouts[index]
                            worker.stall_at = worker.started + self._stall_after(timeouts[index])
                            with contextlib.suppress(OSError):  # a dead worker shows up below
                                worker.conn.send(("task", func, args_list[index]))
                    self._wait_and_collect(outcomes, timeouts, watch_stalls=bool(pending) and not self._wide)
            except BaseException:  # e.g. the stage time limit interrupting the driver
                self._abandon_busy()
                raise
            finally:
                self._shrink()
        return [o if o is not None else TaskOutcome("error", error="lost task") for o in outcomes]

    def submit(self, func: Callable[..., Any], args: tuple, timeout_s: float) -> int:
        """Start ``func(*args)`` on a free worker, or queue it; return its ticket at once.

        ``timeout_s``: seconds it may run, counted from when a started worker receives it
        (time spent queued behind busy workers is not charged). Its outcome comes back
        from :meth:`collect` under the ticket.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s!r}")
        with self._lock:
            if not self._workers or all(w.task_index is None for w in self._workers):
                self._ensure_workers()
            elif self._closed:
                raise RuntimeError("TimeoutPool: used after close()")
            ticket = self._next_ticket
            self._next_ticket += 1
            self._submitted[ticket] = (func, tuple(args))
            self._submitted_timeouts[ticket] = float(timeout_s)
            self._submitted_queue.append(ticket)
            self._send_submitted()
        return ticket

    def collect(self, wait_s: float | None = 0.0, wake: Sequence[Any] = ()) -> dict[int, TaskOutcome]:
        """Outcomes of submitted tasks that finished since the last call, by ticket.

        Waits at most ``wait_s`` seconds (None: until a task finishes, a deadline passes, a
        worker starts or dies, or one of ``wake`` — file descriptors or connections — is
        readable) when nothing has finished yet; may return an empty dict.
        """
        with self._lock:
            self._send_submitted()
            busy = any(w.task_index is not None for w in self._workers)
            if not self._submitted_done and (busy or self._submitted_queue):
                self._wait_and_collect(
                    self._submitted_done,  # type: ignore[arg-type]
                    self._submitted_timeouts,  # type: ignore[arg-type]
                    max_wait=wait_s,
                    wake=wake,
                )
                self._send_submitted()
            done, self._submitted_done = self._submitted_done, {}
            for ticket in done:
                self._submitted.pop(ticket, None)
                self._submitted_timeouts.pop(ticket, None)
        return done

    def _send_submitted(self) -> None:
        """Send queued submitted tasks to the ready, idle workers (the caller holds the lock)."""
        for worker in self._workers:
            if not self._submitted_queue:
                return
            if worker.ready and worker.task_index is None:
                ticket = self._submitted_queue.popleft()
                func, args = self._submitted[ticket]
                worker.task_index = ticket
                worker.started = time.monotonic()
                worker.deadline = worker.started + self._submitted_timeouts[ticket]
                worker.stall_at = worker.deadline
                with contextlib.suppress(OSError):  # a dead worker shows up in _wait_and_collect
                    worker.conn.send(("task", func, args))

    def _stall_after(self, timeout: float) -> float:
        return self._stall_s if self._stall_s is not None else min(1.0, timeout / 4)

    def _widen_if_stalled(self, pending: deque, timeouts: list[float]) -> None:
        """When a running task has stalled and tasks wait, start workers up to ``max_workers``."""
        if not pending:
            return
        now = time.monotonic()
        if not self._wide and any(w.task_index is not None and now >= w.stall_at for w in self._workers):
            self._wide = True
        if not self._wide:
            return
        idle = sum(1 for w in self._workers if w.task_index is None)
        wanted = min(self._max_workers - len(self._workers), len(pending) - idle)
        for _ in range(max(0, wanted)):
            self._workers.append(_Worker(self._context, self._warm_steps))
        self.peak_workers = max(self.peak_workers, len(self._workers))

    def _abandon_busy(self) -> None:
        """Kill the workers still running a task of an interrupted call (their answers would be stale)."""
        for worker in [w for w in self._workers if w.task_index is not None]:
            pid = worker.process.pid
            self._workers.remove(worker)
            worker.kill()
            if self._on_worker_killed is not None and pid is not None:
                with contextlib.suppress(Exception):
                    self._on_worker_killed(pid)

    def _shrink(self) -> None:
        """Stop the idle workers beyond ``num_workers`` (those a stalled call added)."""
        extra = len(self._workers) - self._num_workers
        for worker in [w for w in self._workers if w.task_index is None][: max(0, extra)]:
            self._workers.remove(worker)
            worker.kill()

    def _wait_and_collect(
        self,
        outcomes: list[TaskOutcome | None],
        timeouts: list[float],
        watch_stalls: bool = False,
        max_wait: float | None = None,
        wake: Sequence[Any] = (),
    ) -> None:
        """Wait for the next result, worker start, death, deadline or stall (at most ``max_wait`` s), and record what happened."""
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.task_index is not None]
        if watch_stalls:
            deadlines += [w.stall_at for w in self._workers if w.task_index is not None and w.stall_at > now]
        deadlines += [w.spawned + self.startup_timeout_s for w in self._workers if not w.ready]
        watched = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
        limit = max(0.0, min(deadlines) - now) if deadlines else None
        if max_wait is not None:
            limit = max_wait if limit is None else min(limit, max_wait)
        ready = set(wait([*watched, *wake], timeout=limit))
        now = time.monotonic()
        for worker in list(self._workers):
            has_message = worker.conn in ready or (worker.process.sentinel in ready and worker.conn.poll())
            if not worker.ready:
                answered = False
                while has_message and not worker.ready:
                    try:
                        answered = worker.conn.recv()[0] == "ready"
                    except (EOFError, OSError):
                        answered = False
                    if not answered:
                        break
                    worker.readies_owed -= 1
                    worker.spawned = now  # each further warm-up step has its own start-up limit
                    has_message = worker.conn.poll()
                if not worker.ready and (worker.process.sentinel in ready or (has_message and not answered)):
                    self._startup_failure(worker, f"{self._death_note(worker)} while {worker.warming}")
                elif not worker.ready and now >= worker.spawned + self.startup_timeout_s:
                    self._startup_failure(
                        worker, f"did not finish {worker.warming} within {self.startup_timeout_s:.3g} s"
                    )
                continue
            index = worker.task_index
            if index is None:
                if worker.process.sentinel in ready:  # an idle worker died: replace it quietly
                    self._replace(worker, killed=False)
                continue
            elapsed = now - worker.started
            if has_message:
                try:
                    status, payload = worker.conn.recv()
                except (EOFError, OSError):
                    outcomes[index] = TaskOutcome("error", error=self._death_note(worker), elapsed_s=elapsed)
                    self._replace(worker, killed=False)
                    continue
                worker.task_index = None
                if status == "ok":
                    outcomes[index] = TaskOutcome("ok", value=payload, elapsed_s=elapsed)
                else:
                    outcomes[index] = TaskOutcome("error", error=payload, elapsed_s=elapsed)
            elif worker.process.sentinel in ready:
                outcomes[index] = TaskOutcome("error", error=self._death_note(worker), elapsed_s=elapsed)
                self._replace(worker, killed=False)
            elif now >= worker.deadline:
                outcomes[index] = TaskOutcome(
                    "timeout", error=f"no result after {timeouts[index]:.3g} s", elapsed_s=elapsed
                )
                self._replace(worker, killed=True)

    def _startup_failure(self, worker: _Worker, why: str) -> None:
        self._startup_failures += 1
        if self._startup_failures > 3 * self._num_workers:
            self._close_locked()  # the caller holds the lock
            raise RuntimeError(f"TimeoutPool: worker processes fail to start ({why})")
        self._replace(worker, killed=False)

    @staticmethod
    def _death_note(worker: _Worker) -> str:
        worker.process.join(timeout=1)
        code = worker.process.exitcode
        if code is not None and code < 0:
            try:
                return f"worker process died from signal {signal.Signals(-code).name}"
            except ValueError:
                return f"worker process died from signal {-code}"
        return f"worker process died (exit code {code})"

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []
        self._submitted.clear()
        self._submitted_queue.clear()
        self._closed = True

    def __enter__(self) -> TimeoutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and os is not None:
            with contextlib.suppress(Exception):  # interpreter shutdown
                self.close()
