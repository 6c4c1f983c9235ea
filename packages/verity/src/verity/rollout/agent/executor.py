"""Running tool calls: each in a worker process with a deadline; every failure becomes an answer.

:class:`ToolExecutor` takes calls one by one as the trajectories write them
(:meth:`ToolExecutor.submit`, which never waits), checks each (known tool, arguments that
fit its schema) and runs the rest in a :class:`~verity.rewards.process_pool.TimeoutPool`
— the pool the reward manager uses — with each tool's timeout; :meth:`ToolExecutor.poll`
hands back the calls that finished. At most ``workers`` calls run at once
(``rollout.agent.tool_workers``), and at most a tool's ``max_concurrent`` calls of that
tool; the others wait in a first-in first-out queue (a call held back by its tool's cap
does not hold back calls of other tools). A call's deadline counts from when it starts
running; its time in the queue is reported apart (:attr:`CallOutcome.queued_s`).
Whatever happens, every call gets one :class:`CallOutcome`: the text the model reads
next and a status, ``ok`` or the kind of failure:

==================  =====================================================================
``parse``           the model's call could not be read (counted by the loop; see parsers)
``unknown_tool``    no tool of that name
``bad_arguments``   the arguments do not fit the tool's schema
``too_many_calls``  more calls in one turn than ``max_parallel_calls``
``tool_error``      the tool answered with an error (raised ``ToolError``)
``exception``       the tool raised another exception
``bad_result``      the tool returned something that is not text
``timeout``         no answer within the tool's timeout: its process is killed and replaced
``crash``           the tool's process died (segfault, ``os._exit``, out of memory)
==================  =====================================================================

An error answer reads ``Error: <what happened>``. Every call therefore finishes within its
queue wait plus its timeout, however the tools behave, and a hanging call holds only its
own worker. With ``tool_workers = 0`` calls run in the calling process, one at a time,
without deadlines (for debugging trusted tools only: a hanging tool then hangs the rollout).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from verity.rollout.agent.tool_schema import argument_problems
from verity.rollout.agent.tools import ToolError, ToolSpec, build_tool

__all__ = ["ERROR_KINDS", "CallOutcome", "CallRequest", "ToolExecutor", "error_answer"]

ERROR_KINDS = (
    "parse",
    "unknown_tool",
    "bad_arguments",
    "too_many_calls",
    "tool_error",
    "exception",
    "bad_result",
    "timeout",
    "crash",
)

_PRELOAD = ("verity.rollout.agent.tools", "verity.rollout.agent.calculator", "verity.rewards.sandbox")


@dataclass
class CallRequest:
    """One call to run: the tool ``name`` the model wrote, its ``arguments``, the row's kwargs for it."""

    name: str
    arguments: dict[str, Any]
    row_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class CallOutcome:
    """What one call produced: the ``text`` the model reads, ``status`` (``ok`` or an error kind).

    ``seconds``: how long it ran; ``queued_s``: how long it waited for a free worker first.
    """

    text: str
    status: str = "ok"
    seconds: float = 0.0
    queued_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the tool answered normally."""
        return self.status == "ok"


def error_answer(message: str) -> str:
    """The text of an error answer."""
    return f"Error: {message}"


def run_call(
    spec: ToolSpec, arguments: dict[str, Any], row_kwargs: dict[str, Any], max_chars: int
) -> tuple[str, str]:
    """Run one call here (in a pool worker); ``(kind, text)`` with kind ``ok`` or an error kind.

    The answer text is cut to ``max_chars`` characters (the loop cuts it further, to
    ``max_tool_response_tokens`` tokens) and made valid UTF-8.
    """
    try:
        value = build_tool(spec)(arguments, **row_kwargs)
    except ToolError as err:
        return "tool_error", str(err) or type(err).__name__
    except BaseException as err:  # noqa: BLE001 - any failure of user code becomes an answer
        return "exception", f"{type(err).__name__}: {err}"
    if not isinstance(value, str):
        return "bad_result", f"the tool returned {type(value).__name__}, not text"
    text = value[:max_chars].encode("utf-8", "replace").decode("utf-8")
    return "ok", text


def _import_modules(names: tuple[str, ...]) -> None:
    """A tool process's start-up step: import the executor and the tools' modules (never charged to a call)."""
    import importlib

    for name in names:
        with contextlib.suppress(Exception):  # a broken tool module shows up as its calls' errors
            importlib.import_module(name)


def _cleanup_after_killed_worker(pid: int) -> None:
    from verity.rewards.sandbox import cleanup_after_worker

    cleanup_after_worker(pid)


@dataclass
class _Call:
    """A submitted call the executor still owes an outcome for."""

    ticket: int
    spec: ToolSpec
    task: tuple
    submitted: float
    started: float | None = None


class ToolExecutor:
    """Runs tool calls with caps, a queue and deadlines (see the module docstring).

    Args:
        specs: the resolved tools (:func:`verity.rollout.agent.tools.resolve_tools`); each
            spec's ``max_concurrent`` caps its own calls running at once.
        workers: worker processes, and so calls running at once (0: run in this process,
            one at a time, no deadlines).
        max_chars: characters of an answer kept before tokenization.
    """

    def __init__(self, specs: list[ToolSpec], workers: int = 1, max_chars: int = 65536) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.workers = workers
        self.max_chars = max_chars
        self._pool: Any = None
        self._init_runtime()

    def _init_runtime(self) -> None:
        """The queue, the running calls and the thread that starts and collects them."""
        self._cv = threading.Condition()
        self._next_ticket = 0
        self._queue: list[_Call] = []  # waiting to start, in submission order
        self._running: dict[int, _Call] = {}  # pool ticket -> call
        self._finished: list[tuple[int, CallOutcome]] = []  # answered, not yet handed back by poll
        self._pump: threading.Thread | None = None
        self._closing = False
        self._wake_r, self._wake_w = -1, -1

    def _get_pool(self) -> Any:
        if self._pool is None:
            from verity.rewards.process_pool import TimeoutPool

            modules = {__name__, *(spec.target.partition(":")[0] for spec in self.specs.values())}
            self._pool = TimeoutPool(
                self.workers,
                preload=_PRELOAD,
                on_worker_killed=_cleanup_after_killed_worker,
                initializer=(_import_modules, (tuple(sorted(modules)),)),
            )
        return self._pool

    # ------------------------------------------------------------------ one call at a time
    def submit(self, request: CallRequest) -> int:
        """Queue ``request`` (it starts at once when the caps allow); return its ticket, never waiting.

        A call to an unknown tool or with arguments that do not fit the schema is answered
        at once (its outcome comes from the next :meth:`poll`). With ``workers = 0`` the
        call runs here, before this returns.
        """
        with self._cv:
            ticket = self._next_ticket
            self._next_ticket += 1
        spec = self.specs.get(request.name)
        if spec is None:
            known = ", ".join(sorted(self.specs))
            message = f"there is no tool {request.name!r}; tools: {known}"
            self._deliver([(ticket, CallOutcome(error_answer(message), "unknown_tool"))])
            return ticket
        problems = argument_problems(request.arguments, spec.schema.parameters)
        if problems:
            message = f"bad arguments for {spec.name}: {'; '.join(problems[:3])}"
            self._deliver([(ticket, CallOutcome(error_answer(message), "bad_arguments"))])
            return ticket
        task = (spec, request.arguments, request.row_kwargs, self.max_chars)
        call = _Call(ticket, spec, task, time.monotonic())
        if self.workers == 0:
            start = time.monotonic()
            kind, text = run_call(*task)
            outcome = self._answer(spec, kind, text, time.monotonic() - start)
            outcome.queued_s = start - call.submitted
            self._deliver([(ticket, outcome)])
            return ticket
        with self._cv:
            self._queue.append(call)
            self._ensure_pump()
            self._cv.notify_all()
        os.write(self._wake_w, b"x")  # the pump may be waiting on the pool: start the call now
        return ticket

    def busy(self) -> int:
        """Calls submitted and not yet handed back by :meth:`poll` (queued, running or answered)."""
        with self._cv:
            return len(self._queue) + len(self._running) + len(self._finished)

    def poll(self, wait: bool = False) -> list[tuple[int, CallOutcome]]:
        """``(ticket, outcome)`` of the calls answered since the last poll, in the order they finished.

        ``wait``: block until at least one call is answered (returns at once when none is
        submitted); otherwise never blocks.
        """
        with self._cv:
            while wait and not self._finished and (self._queue or self._running):
                self._cv.wait()
            done, self._finished = self._finished, []
        return done

    def _deliver(self, outcomes: list[tuple[int, CallOutcome]]) -> None:
        with self._cv:
            self._finished += outcomes
            self._cv.notify_all()

    def _ensure_pump(self) -> None:
        """Start the thread that starts and collects calls (the caller holds the condition)."""
        if self._pump is not None and self._pump.is_alive():
            return
        if self._wake_r < 0:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
        self._closing = False
        self._pump = threading.Thread(target=self._pump_loop, name="verity-tool-calls", daemon=True)
        self._pump.start()

    def _pump_loop(self) -> None:
        """Start queued calls as the caps allow and hand back finished ones, until closed.

        Runs in its own thread, so calls start and finish while the loop's thread is in the
        engine; it waits on the pool's workers and on a wake-up pipe, never spins.
        """
        while True:
            with self._cv:
                while not self._closing and not self._queue and not self._running:
                    self._cv.wait()
                if self._closing:
                    return
                try:
                    self._start_queued()
                except Exception as err:  # noqa: BLE001 - the pool cannot start: every queued call is answered
                    started = set(map(id, self._running.values()))
                    self._fail([c for c in self._queue if id(c) not in started], err)
                    self._queue = []
                running = bool(self._running)
            self._drain_wake()
            if not running:
                continue
            try:
                done = self._get_pool().collect(None, wake=[self._wake_r])
            except Exception as err:  # noqa: BLE001 - the pool broke: every running call is answered
                with self._cv:
                    self._fail(list(self._running.values()), err)
                    self._running.clear()
                continue
            finished = []
            with self._cv:
                for pool_ticket, outcome in done.items():
                    call = self._running.pop(pool_ticket, None)
                    if call is None:
                        continue  # dropped by close()
                    result = self._from_pool(call.spec, outcome)
                    result.queued_s = (call.started or call.submitted) - call.submitted
                    finished.append((call.ticket, result))
                self._finished += finished
                self._cv.notify_all()

    def _fail(self, calls: list[_Call], err: Exception) -> None:
        """Answer ``calls`` with a crash (the lock held)."""
        for call in calls:
            text = error_answer(f"{call.spec.name} could not run (tool pool: {err})")
            self._finished.append((call.ticket, CallOutcome(text, "crash")))
        self._cv.notify_all()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _start_queued(self) -> None:
        """Start queued calls, oldest first, while the worker cap and their tools' caps allow (lock held)."""
        per_tool: dict[str, int] = {}
        for call in self._running.values():
            per_tool[call.spec.name] = per_tool.get(call.spec.name, 0) + 1
        waiting: list[_Call] = []
        for call in self._queue:
            cap = call.spec.max_concurrent
            full = len(self._running) >= self.workers
            if full or (cap is not None and per_tool.get(call.spec.name, 0) >= cap):
                waiting.append(call)
                continue
            call.started = time.monotonic()
            self._running[self._get_pool().submit(run_call, call.task, call.spec.timeout_s)] = call
            per_tool[call.spec.name] = per_tool.get(call.spec.name, 0) + 1
        self._queue = waiting

    # ------------------------------------------------------------------ a round at once
    def run(self, requests: list[CallRequest]) -> list[CallOutcome]:
        """One :class:`CallOutcome` per request, in order (never raises for a tool's behaviour).

        Submits them all and waits for every one; calls submitted before and not yet
        polled are polled here too, and their outcomes are dropped.
        """
        tickets = [self.submit(request) for request in requests]
        outcomes: dict[int, CallOutcome] = {}
        wanted = set(tickets)
        while not wanted.issubset(outcomes):
            outcomes.update(self.poll(wait=True))
        return [outcomes[t] for t in tickets]

    def _from_pool(self, spec: ToolSpec, outcome: Any) -> CallOutcome:
        if outcome.status == "ok":
            kind, text = outcome.value
            return self._answer(spec, kind, text, outcome.elapsed_s)
        if outcome.status == "timeout":
            message = f"{spec.name} did not answer within {spec.timeout_s:g} s"
            return CallOutcome(error_answer(message), "timeout", outcome.elapsed_s)
        reason = (outcome.error or "").strip().splitlines()
        reason_text = reason[0] if reason else "no reason"
        return CallOutcome(error_answer(f"{spec.name} crashed ({reason_text})"), "crash", outcome.elapsed_s)

    @staticmethod
    def _answer(spec: ToolSpec, kind: str, text: str, seconds: float) -> CallOutcome:
        if kind == "ok":
            return CallOutcome(text, "ok", seconds)
        if kind == "tool_error":
            return CallOutcome(error_answer(text), kind, seconds)
        return CallOutcome(error_answer(f"{spec.name} failed: {text}"), kind, seconds)

    def close(self) -> None:
        """Stop the worker processes and drop unfinished calls (a later call starts new workers)."""
        with self._cv:
            self._closing = True
            self._queue, self._running, self._finished = [], {}, []
            self._cv.notify_all()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._pump is not None:
            self._pump.join(timeout=30)
            self._pump = None
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.close()
            self._pool = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r, self._wake_w = -1, -1

    def __getstate__(self) -> dict[str, Any]:
        return {"specs": self.specs, "workers": self.workers, "max_chars": self.max_chars}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = None
        self._init_runtime()
