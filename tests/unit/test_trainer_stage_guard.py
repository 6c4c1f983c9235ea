"""StageGuard without Ray: a driver-side stage that outlives its limit is interrupted and named."""

from __future__ import annotations

import time

import pytest
from verity.trainer.stage_guard import StageGuard, StageTimeoutError


def spin(seconds: float) -> None:
    """A busy Python loop (a stuck reward function, say)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


class FakeGroup:
    """Answers ``stacks()`` like a worker group whose rank 1 is stuck in ``generate``."""

    def stacks(self, timeout_s: float):
        return {
            0: {"pid": 10, "busy": None, "threads": {}},
            1: {
                "pid": 11,
                "busy": {
                    "role": "worker",
                    "method": "generate",
                    "seconds": 2.5,
                    "stack": "  File x, in generate\n",
                },
                "threads": {},
            },
            2: None,  # did not answer
        }


def test_a_stage_over_its_limit_raises_naming_stage_step_and_busy_workers():
    guard = StageGuard(0.3, {"actor": FakeGroup()})
    start = time.monotonic()
    with pytest.raises(StageTimeoutError) as info, guard.stage("reward", step=4):
        spin(20.0)
    assert time.monotonic() - start < 10.0  # interrupted, not waited out
    err = info.value
    assert err.stage == "reward" and err.step == 4 and err.timeout_s == pytest.approx(0.3)
    message = str(err)
    assert "stage 'reward' at step 4 exceeded trainer.stage_timeout_s = 0.3 s" in message
    assert "actor rank 1 (generate)" in message and "in generate" in message
    assert "actor rank 2: no answer" in message
    assert "driver (main thread)" in message and "spin" in message
    assert [(g, r, m) for g, r, m, _ in err.busy] == [("actor", 1, "generate"), ("actor", 2, "?")]


def test_a_stage_within_its_limit_is_untouched_and_errors_pass_through():
    guard = StageGuard(5.0)
    with guard.stage("advantage", step=1):
        spin(0.05)
    with pytest.raises(KeyError, match="boom"), guard.stage("advantage", step=1):
        raise KeyError("boom")
    time.sleep(0.1)  # no late interrupt arrives after the stage ended


def test_zero_means_no_limit():
    guard = StageGuard(0)
    with guard.stage("generate"):
        spin(0.05)
    with guard.stage("update_actor"):
        time.sleep(0.3)  # past any limit a zero could be mistaken for: nothing interrupts it
    assert guard.timeout_s == 0


def test_outside_the_main_thread_the_overrun_is_reported_when_the_stage_returns():
    import threading

    caught: list[BaseException] = []

    def drive() -> None:
        try:
            with StageGuard(0.2).stage("generate", step=2):
                spin(0.6)
        except BaseException as err:  # noqa: BLE001 (the test inspects whatever came out)
            caught.append(err)

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join(timeout=30)
    assert len(caught) == 1 and isinstance(caught[0], StageTimeoutError)
    assert caught[0].stage == "generate" and "spin" in str(caught[0])


def test_one_watchdog_thread_serves_every_stage_and_each_stage_gets_its_own_limit():
    import threading

    guard = StageGuard(0.4)
    with guard.stage("warm", step=0):
        pass
    watchdog = guard._watchdog._thread
    before = set(threading.enumerate())  # other guards' idle watchdogs may end meanwhile: count new ones only
    for step in range(200):  # stages that end in time start no thread
        with guard.stage("reward", step=step):
            pass
    assert set(threading.enumerate()) - before == set()
    assert guard._watchdog._thread is watchdog
    started = time.monotonic()
    with (
        pytest.raises(StageTimeoutError, match="stage 'advantage' at step 7"),
        guard.stage("advantage", step=7),
    ):
        spin(5.0)
    assert time.monotonic() - started < 3.0  # the limit counts from this stage's start, not the guard's
    with guard.stage("update_actor", step=7):  # after a stage fired, the next one is watched afresh
        spin(0.1)
    with (
        pytest.raises(StageTimeoutError, match="stage 'generate' at step 8"),
        guard.stage("generate", step=8),
    ):
        spin(5.0)


def test_the_watchdog_thread_of_an_idle_guard_ends_and_a_later_stage_starts_one_again(monkeypatch):
    import verity.trainer.stage_guard as stage_guard

    monkeypatch.setattr(stage_guard, "WATCHDOG_IDLE_EXIT_S", 0.2)
    guard = StageGuard(0.4)
    with guard.stage("generate", step=1):
        pass
    thread = guard._watchdog._thread
    assert thread is not None
    thread.join(timeout=30)
    assert not thread.is_alive() and guard._watchdog._thread is None
    with pytest.raises(StageTimeoutError, match="stage 'reward' at step 2"), guard.stage("reward", step=2):
        spin(5.0)
