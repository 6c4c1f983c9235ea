"""Start-up of the reward pool is not a sample's time: loading a reward function never times a sample out.

A sample's ``timeout_s`` counts its own scoring only. Starting a worker and loading what it
will run (a plug-in's task, a user module) happens before, under the pool's start-up limit;
a pool that cannot start raises an error naming what it was loading.
"""

from __future__ import annotations

import operator
import os
import time

import pytest
from verity.rewards.process_pool import TimeoutPool


def test_warm_up_is_not_charged_to_tasks_and_replacement_workers_run_it_too():
    with TimeoutPool(1) as pool:
        pool.warm_up(time.sleep, (2.0,))  # longer than any task below may take
        assert pool.map(operator.add, [(1, 2)], 1.0)[0].value == 3
        hung = pool.map(time.sleep, [(60,)], 1.0)[0]
        assert hung.status == "timeout"  # its worker was killed; the fresh one sleeps 2 s at start-up
        outcome = pool.map(operator.add, [(2, 3)], 1.0)[0]
    assert outcome.status == "ok" and outcome.value == 5, outcome


def test_a_warm_up_that_never_ends_raises_naming_it():
    pool = TimeoutPool(1, startup_timeout_s=0.5)
    with pytest.raises(RuntimeError, match=r"fail to start \(did not finish .*sleep\(3600,\).* within 0.5 s"):
        pool.warm_up(time.sleep, (3600,))
    with pytest.raises(RuntimeError, match="used after close"):
        pool.map(operator.add, [(1, 2)], 1.0)


def test_a_warm_up_that_kills_its_worker_raises_naming_it():
    pool = TimeoutPool(1)
    with pytest.raises(
        RuntimeError, match=r"fail to start \(worker process died \(exit code 3\) while .*_exit\(3,\)"
    ):
        pool.warm_up(os._exit, (3,))
