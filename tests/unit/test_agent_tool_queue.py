"""Tool calls without blocking: the pool's submit/collect, the executor's caps, queue and bad tools.

Ordering is asserted on events (which call finished first, which intervals overlap, as the
tools themselves stamp them with the machine-wide monotonic clock), never on wall-clock
thresholds.
"""

from __future__ import annotations

import importlib
import time

import pytest
from helpers.light_tools import light_tools
from verity.rewards.process_pool import TimeoutPool
from verity.rollout.agent.config import AgentConfig, ToolConfig
from verity.rollout.agent.executor import CallRequest, ToolExecutor
from verity.rollout.agent.tools import resolve_tools


def _specs(caps: dict[str, int] | None = None, hang_timeout_s: float = 3.0):
    tools = [ToolConfig(**entry) for entry in light_tools(hang_timeout_s, caps)]
    return resolve_tools(AgentConfig(enabled=True, tools=tools))


def _warm(executor: ToolExecutor) -> None:
    """Start every worker and import the tools there, so no start-up or import shows in an order."""
    executor._get_pool().warm_up(importlib.import_module, ("helpers.light_tools",))


def test_submitted_tasks_finish_on_their_own_and_map_waits_for_them() -> None:
    with TimeoutPool(2) as pool:
        hung = pool.submit(time.sleep, (3600,), 1.0)
        failed = pool.submit(int, ("nope",), 60.0)
        fine = pool.submit(str.upper, ("ok",), 60.0)
        order: list[int] = []
        outcomes = {}
        while len(outcomes) < 3:
            done = pool.collect(None)
            order += sorted(done, key=lambda t: done[t].elapsed_s)
            outcomes.update(done)
        assert outcomes[fine].status == "ok" and outcomes[fine].value == "OK"
        assert outcomes[failed].status == "error" and "ValueError: invalid literal" in outcomes[failed].error
        assert outcomes[hung].status == "timeout"
        assert order[-1] == hung  # the hung task held one worker; the others used the second
        pool.submit(time.sleep, (0,), 60.0)
        with pytest.raises(RuntimeError, match="submitted tasks are still unfinished"):
            pool.map(str.upper, [("a",)], 60.0)
        while not pool.collect(None):
            pass
        assert [o.value for o in pool.map(str.upper, [("a",), ("b",)], 60.0)] == ["A", "B"]


def _intervals(outcomes) -> list[tuple[float, float]]:
    return [tuple(float(x) for x in o.text.split(",")) for o in outcomes]


def test_a_tool_cap_queues_its_calls_in_order_while_other_tools_run() -> None:
    executor = ToolExecutor(_specs({"stamp": 1}), workers=3)
    try:
        _warm(executor)
        stamps = [executor.submit(CallRequest("stamp", {"text": "0.4"})) for _ in range(3)]
        echo = executor.submit(CallRequest("echo", {"text": "hi"}))
        finished = []
        while executor.busy():
            finished += executor.poll(wait=True)
    finally:
        executor.close()
    by_ticket = dict(finished)
    runs = _intervals([by_ticket[t] for t in stamps])
    # one stamp call at a time, first in first out
    assert all(runs[k + 1][0] >= runs[k][1] for k in range(2)), runs
    assert [t for t, _ in finished if t in stamps] == stamps
    assert by_ticket[stamps[0]].queued_s < by_ticket[stamps[1]].queued_s < by_ticket[stamps[2]].queued_s
    # the echo call, submitted after the queued stamps, was not held behind them
    assert [t for t, _ in finished].index(echo) < [t for t, _ in finished].index(stamps[1]), [
        (t, o.status, round(o.seconds, 3), round(o.queued_s, 3), o.text[:30]) for t, o in finished
    ]
    assert by_ticket[echo].ok


def test_the_worker_cap_queues_calls_of_every_tool() -> None:
    executor = ToolExecutor(_specs(), workers=1)
    try:
        tickets = [executor.submit(CallRequest("stamp", {"text": "0.2"})) for _ in range(2)]
        outcomes = dict(executor.poll(wait=True))
        while len(outcomes) < 2:
            outcomes.update(executor.poll(wait=True))
    finally:
        executor.close()
    first, second = _intervals([outcomes[t] for t in tickets])
    assert second[0] >= first[1] and outcomes[tickets[1]].queued_s > 0


def test_hanging_raising_and_flooding_tools_are_answered_and_hold_up_nothing_else() -> None:
    executor = ToolExecutor(_specs(hang_timeout_s=3.0), workers=2, max_chars=1000)
    try:
        _warm(executor)
        hang = executor.submit(CallRequest("hang", {"text": "x"}))
        others = [
            executor.submit(CallRequest("fail", {"text": "x"})),
            executor.submit(CallRequest("flood", {"text": "x"})),
            executor.submit(CallRequest("calculator", {"expression": "6*7"})),
            executor.submit(CallRequest("nosuch", {})),
        ]
        finished = []
        while executor.busy():
            finished += executor.poll(wait=True)
    finally:
        executor.close()
    order = [t for t, _ in finished]
    outcome = dict(finished)
    details = [(t, o.status, round(o.seconds, 3), round(o.queued_s, 3)) for t, o in finished]
    assert order[-1] == hang and sorted(order[:-1]) == sorted(others), details
    assert outcome[hang].status == "timeout" and outcome[hang].text == "Error: hang did not answer within 3 s"
    assert outcome[others[0]].status == "exception"
    assert outcome[others[1]].ok and outcome[others[1]].text == "y" * 1000  # cut to max_chars
    assert outcome[others[2]].text == "42"
    assert outcome[others[3]].status == "unknown_tool"


def test_run_still_answers_a_round_in_order() -> None:
    executor = ToolExecutor(_specs(), workers=0)
    outcomes = executor.run(
        [CallRequest("calculator", {"expression": "2+2"}), CallRequest("calculator", {"expression": 1})]
    )
    assert [o.status for o in outcomes] == ["ok", "bad_arguments"] and outcomes[0].text == "4"


def test_max_concurrent_is_checked_with_the_tools() -> None:
    from verity.config import ConfigError, load_config

    on = "rollout.agent.enabled=true"
    cfg = load_config([on, "rollout.agent.tools=[{class_name: calculator, max_concurrent: 2}]"])
    assert resolve_tools(cfg.rollout.agent)[0].max_concurrent == 2
    message = r"rollout.agent.tools\[0\].max_concurrent: expected null or an int >= 1, got 0"
    with pytest.raises(ConfigError, match=message):
        load_config([on, "rollout.agent.tools=[{class_name: calculator, max_concurrent: 0}]"])
