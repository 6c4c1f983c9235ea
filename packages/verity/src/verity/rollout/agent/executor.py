"""Running tool calls: each in a worker process with a deadline; every failure becomes an answer.

:class:`ToolExecutor` takes the calls of one round (all rows' calls together), checks
each (known tool, arguments that fit its schema) and runs the rest in a
:class:`~verity.rewards.process_pool.TimeoutPool` — the pool the reward manager uses —
with each tool's timeout. Whatever happens, every call gets one :class:`CallOutcome`:
the text the model reads next and a status, ``ok`` or the kind of failure:

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

An error answer reads ``Error: <what happened>``. A round therefore always returns,
in at most about ``ceil(calls / tool_workers) x timeout`` seconds, however the tools
behave. With ``tool_workers = 0`` calls run in the calling process without deadlines
(for debugging trusted tools only: a hanging tool then hangs the rollout).
"""

from __future__ import annotations

import contextlib
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
    """What one call produced: the ``text`` the model reads, ``status`` (``ok`` or an error kind), seconds."""

    text: str
    status: str = "ok"
    seconds: float = 0.0

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


def _cleanup_after_killed_worker(pid: int) -> None:
    from verity.rewards.sandbox import cleanup_after_worker

    cleanup_after_worker(pid)


class ToolExecutor:
    """Runs rounds of tool calls (see the module docstring).

    Args:
        specs: the resolved tools (:func:`verity.rollout.agent.tools.resolve_tools`).
        workers: worker processes (0: run in this process, no deadlines).
        max_chars: characters of an answer kept before tokenization.
    """

    def __init__(self, specs: list[ToolSpec], workers: int = 1, max_chars: int = 65536) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.workers = workers
        self.max_chars = max_chars
        self._pool: Any = None

    def _get_pool(self) -> Any:
        if self._pool is None:
            from verity.rewards.process_pool import TimeoutPool

            self._pool = TimeoutPool(
                self.workers, preload=_PRELOAD, on_worker_killed=_cleanup_after_killed_worker
            )
        return self._pool

    def run(self, requests: list[CallRequest]) -> list[CallOutcome]:
        """One :class:`CallOutcome` per request, in order (never raises for a tool's behaviour)."""
        outcomes: list[CallOutcome | None] = [None] * len(requests)
        runnable: list[int] = []
        for index, request in enumerate(requests):
            spec = self.specs.get(request.name)
            if spec is None:
                known = ", ".join(sorted(self.specs))
                outcomes[index] = CallOutcome(
                    error_answer(f"there is no tool {request.name!r}; tools: {known}"), "unknown_tool"
                )
                continue
            problems = argument_problems(request.arguments, spec.schema.parameters)
            if problems:
                outcomes[index] = CallOutcome(
                    error_answer(f"bad arguments for {spec.name}: {'; '.join(problems[:3])}"), "bad_arguments"
                )
                continue
            runnable.append(index)
        tasks = [
            (self.specs[requests[i].name], requests[i].arguments, requests[i].row_kwargs, self.max_chars)
            for i in runnable
        ]
        for index, outcome in zip(runnable, self._execute(tasks), strict=True):
            outcomes[index] = outcome
        return [o if o is not None else CallOutcome(error_answer("lost call"), "crash") for o in outcomes]

    def _execute(self, tasks: list[tuple]) -> list[CallOutcome]:
        if not tasks:
            return []
        if self.workers == 0:
            results = []
            for task in tasks:
                start = time.perf_counter()
                kind, text = run_call(*task)
                results.append(self._answer(task[0], kind, text, time.perf_counter() - start))
            return results
        timeouts = [task[0].timeout_s for task in tasks]
        pool_outcomes = self._get_pool().map(run_call, tasks, timeouts)
        results = []
        for task, outcome in zip(tasks, pool_outcomes, strict=True):
            spec = task[0]
            if outcome.status == "ok":
                kind, text = outcome.value
                results.append(self._answer(spec, kind, text, outcome.elapsed_s))
            elif outcome.status == "timeout":
                message = f"{spec.name} did not answer within {spec.timeout_s:g} s"
                results.append(CallOutcome(error_answer(message), "timeout", outcome.elapsed_s))
            else:
                reason = (outcome.error or "").strip().splitlines()
                reason_text = reason[0] if reason else "no reason"
                message = f"{spec.name} crashed ({reason_text})"
                results.append(CallOutcome(error_answer(message), "crash", outcome.elapsed_s))
        return results

    @staticmethod
    def _answer(spec: ToolSpec, kind: str, text: str, seconds: float) -> CallOutcome:
        if kind == "ok":
            return CallOutcome(text, "ok", seconds)
        if kind == "tool_error":
            return CallOutcome(error_answer(text), kind, seconds)
        return CallOutcome(error_answer(f"{spec.name} failed: {text}"), kind, seconds)

    def close(self) -> None:
        """Stop the worker processes (a later :meth:`run` starts new ones)."""
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pool"] = None
        return state
