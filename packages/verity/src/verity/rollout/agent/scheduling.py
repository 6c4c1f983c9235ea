"""When trajectories advance: the agent loop's event loop over a request scheduler and the tools.

:func:`run_trajectories` drives every trajectory of a ``generate`` call with one
:class:`~verity.rollout.requests.RequestScheduler` (the engine's continuous-batching side)
and one :class:`~verity.rollout.agent.executor.ToolExecutor`::

    add every trajectory's first request
    while anything is held, running or ready:
        step the scheduler (if it holds requests); for each finished request:
            take its tokens (TurnRules); turn over -> parse, submit its calls at once;
            a turn cut by max_model_len -> its continuation is ready at once
        pick up the tool calls that finished (without waiting); a trajectory whose
            answers are all back gets them appended and its next request is ready
        add the ready requests
        nothing held but tools running -> block until the first call finishes

Two policies decide when ready requests are added:

- ``request`` (the default, :data:`REQUEST_LEVEL`): at once. Each trajectory advances on
  its own; the engine keeps decoding the others while a trajectory's tools run.
- ``barrier`` (:data:`TURN_BARRIER`): only when no trajectory is generating and no tool
  runs; then every ready request is added, in trajectory order. This is the older
  turn-synchronous loop, kept internal: the benchmark
  ``packages/verity/benchmarks/bench_agent_rollout.py`` and the equivalence tests compare
  against it, and the loop uses it when the engine has ``tensor_parallel_size > 1`` (the
  ranks of a replica must make the same add/step calls, and with the barrier those depend
  only on the model's tokens, never on which rank's tool answered first).

Under greedy decoding with deterministic tools both policies give every trajectory the
same tokens (the rules of :class:`~verity.rollout.agent.turns.TurnRules` see only the
trajectory itself).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from verity.rollout.agent.executor import CallOutcome, ToolExecutor
from verity.rollout.agent.trajectory import TrajectoryState
from verity.rollout.agent.turns import CONTINUE, TURN_OVER, TurnRules
from verity.rollout.requests import RequestScheduler

__all__ = ["POLICIES", "REQUEST_LEVEL", "TURN_BARRIER", "LoopStats", "run_trajectories"]

REQUEST_LEVEL, TURN_BARRIER = "request", "barrier"
POLICIES = (REQUEST_LEVEL, TURN_BARRIER)


@dataclass
class LoopStats:
    """What one run of the loop measured (seconds from ``time.monotonic``).

    ``tool_wait_s`` / ``tool_queue_s``: per trajectory, seconds from the end of a turn
    to its last tool answer (queue included) / seconds its calls waited for a free
    worker, summed over its turns. ``busy_s``: seconds spent in the scheduler's ``step``
    with requests held; ``in_flight``: requests held at each step.
    """

    wall_s: float = 0.0
    busy_s: float = 0.0
    steps: int = 0
    in_flight: list[int] = field(default_factory=list)
    tool_wait_s: list[float] = field(default_factory=list)
    tool_queue_s: list[float] = field(default_factory=list)

    @property
    def busy_fraction(self) -> float:
        """Share of the wall time the engine was stepping requests (0 when nothing ran)."""
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def in_flight_mean(self) -> float:
        """Mean requests held per scheduler step."""
        return sum(self.in_flight) / len(self.in_flight) if self.in_flight else 0.0

    @property
    def in_flight_max(self) -> int:
        """Most requests held at one step."""
        return max(self.in_flight, default=0)


@dataclass
class _Waiting:
    """A trajectory waiting for its tool answers."""

    names: list[str]
    outcomes: list[CallOutcome | None]
    since: float
    owed: int = 0


def run_trajectories(
    states: list[TrajectoryState],
    scheduler: RequestScheduler,
    executor: ToolExecutor,
    rules: TurnRules,
    policy: str = REQUEST_LEVEL,
) -> LoopStats:
    """Advance every trajectory of ``states`` until it is finished (see the module docstring).

    ``states`` are updated in place. Returns the :class:`LoopStats` of the run; raises
    ValueError for an unknown ``policy`` or a context that leaves no room to generate.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {'|'.join(POLICIES)}, got {policy!r}")
    loop = _EventLoop(states, scheduler, executor, rules, policy == TURN_BARRIER)
    return loop.run()


class _EventLoop:
    def __init__(
        self,
        states: list[TrajectoryState],
        scheduler: RequestScheduler,
        executor: ToolExecutor,
        rules: TurnRules,
        barrier: bool,
    ) -> None:
        self.states = states
        self.scheduler = scheduler
        self.executor = executor
        self.rules = rules
        self.barrier = barrier
        self.stats = LoopStats(tool_wait_s=[0.0] * len(states), tool_queue_s=[0.0] * len(states))
        self.ready = [i for i, s in enumerate(states) if not s.done]
        self.owner: dict[int, int] = {}  # request id -> trajectory
        self.generating = 0
        self.next_request = 0
        self.waiting: dict[int, _Waiting] = {}  # trajectory -> its owed answers
        self.call_owner: dict[int, tuple[int, int]] = {}  # executor ticket -> (trajectory, slot)

    def run(self) -> LoopStats:
        start = time.monotonic()
        while True:
            self._add_ready()
            held = self.scheduler.pending()
            if held:
                self.stats.in_flight.append(held)
                stepped = time.monotonic()
                finished = self.scheduler.step()
                self.stats.busy_s += time.monotonic() - stepped
                self.stats.steps += 1
                for done in finished:
                    self._take(self.owner.pop(done.request_id), done.token_ids, done.logprobs)
                self._answers(self.executor.poll(wait=False))
            elif self.call_owner:
                self._answers(self.executor.poll(wait=True))
            elif not self.ready:
                break
        self.stats.wall_s = time.monotonic() - start
        return self.stats

    def _add_ready(self) -> None:
        if not self.ready or (self.barrier and (self.generating or self.call_owner)):
            return
        for index in sorted(self.ready):
            request = self.rules.request(self.states[index], self.next_request)
            self.owner[self.next_request] = index
            self.next_request += 1
            self.generating += 1
            self.scheduler.add(request)
        self.ready = []

    def _take(self, index: int, tokens: list[int], logprobs: list[float]) -> None:
        self.generating -= 1
        state = self.states[index]
        what = self.rules.take_tokens(state, tokens, logprobs)
        if what == CONTINUE:
            self.ready.append(index)
        elif what == TURN_OVER:
            plan = self.rules.end_turn(state)
            if plan is None:
                return
            names = [name for name, _ in plan.slots]
            known = [c if isinstance(c, CallOutcome) else None for _, c in plan.slots]
            waiting = _Waiting(names, known, time.monotonic())
            for slot, call in plan.calls():
                self.call_owner[self.executor.submit(call)] = (index, slot)
                waiting.owed += 1
            if waiting.owed:
                self.waiting[index] = waiting
            else:
                self._answer(index, waiting)

    def _answers(self, finished: list[tuple[int, CallOutcome]]) -> None:
        for ticket, outcome in finished:
            if ticket not in self.call_owner:
                continue  # a call left over from an earlier run that raised
            index, slot = self.call_owner.pop(ticket)
            waiting = self.waiting[index]
            waiting.outcomes[slot] = outcome
            waiting.owed -= 1
            self.stats.tool_queue_s[index] += outcome.queued_s
            if waiting.owed == 0:
                del self.waiting[index]
                self.stats.tool_wait_s[index] += time.monotonic() - waiting.since
                self._answer(index, waiting)

    def _answer(self, index: int, waiting: _Waiting) -> None:
        named = [(n, o) for n, o in zip(waiting.names, waiting.outcomes, strict=True) if o is not None]
        if self.rules.answer(self.states[index], named):
            self.ready.append(index)
