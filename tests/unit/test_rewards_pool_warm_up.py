"""Start-up of the reward pool is not a sample's time: loading a reward function never times a sample out.

A sample's ``timeout_s`` counts its own scoring only. Starting a worker and loading what it
will run (a plug-in's task, a user module) happens before, under the pool's start-up limit;
a pool that cannot start raises an error naming what it was loading.
"""

from __future__ import annotations

import operator
import os
import sys
import time

import pytest
from verity.rewards import RewardManager
from verity.rewards.process_pool import TimeoutPool

SAMPLE_TIMEOUT_S = 2.0
IMPORT_S = 2 * SAMPLE_TIMEOUT_S  # the plug-in's import in a worker: longer than a sample may take

PLUGIN_MODULE = "slow_import_task_plugin"
PLUGIN = """
import os, sys, time

if os.getpid() != int(os.environ["SLOW_PLUGIN_DRIVER_PID"]):  # slow in the reward workers only
    time.sleep(float(os.environ["SLOW_PLUGIN_IMPORT_S"]))

from verity.data.task_registry import register_task

DATA_SOURCE = "test/slow_import_task"


class SlowImportConfig:
    pass


def generate_splits(num_train, num_test, seed, config):
    return [], []


def score(response_text, ground_truth):
    return float(response_text.strip() == ground_truth)


register_task("slow_import_task", sys.modules[__name__])
"""


@pytest.fixture
def slow_plugin(tmp_path, monkeypatch):
    """A plug-in (named by ``VERITY_PLUGINS``) registering a task; importing it takes ``IMPORT_S`` in a worker."""
    import verity.plugins as plugins
    from verity.data.task_registry import TASKS

    (tmp_path / f"{PLUGIN_MODULE}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("VERITY_PLUGINS", PLUGIN_MODULE)
    monkeypatch.setenv("SLOW_PLUGIN_DRIVER_PID", str(os.getpid()))
    monkeypatch.setenv("SLOW_PLUGIN_IMPORT_S", str(IMPORT_S))
    # this process's registries get the task for the test only
    monkeypatch.setattr(plugins, "_loaded", dict(plugins._loaded))
    monkeypatch.setattr(TASKS, "_entries", dict(TASKS._entries))
    monkeypatch.setattr(TASKS, "_canonical", dict(TASKS._canonical))
    yield "test/slow_import_task"
    sys.modules.pop(PLUGIN_MODULE, None)


def test_a_plug_in_task_slow_to_import_scores_without_timing_out(slow_plugin):
    rows = [
        {"data_source": slow_plugin, "solution_str": "12", "ground_truth": "12"},
        {"data_source": slow_plugin, "solution_str": "13", "ground_truth": "12"},
    ]
    config = {
        "num_workers": 1,
        "timeout_s": SAMPLE_TIMEOUT_S,
        "inline_builtin": False,  # the task is scored in the pool, as a plug-in's function would be
        "start_method": "spawn",  # a fresh interpreter that sees this test's VERITY_PLUGINS
    }
    with RewardManager(config) as manager:
        scores, extra, metrics = manager.score(rows)
        pid = manager._pool.worker_pids()[0]
        again, _, _ = manager.score(rows)  # loaded once: the same worker scores the next call
        assert manager._pool.worker_pids() == [pid]
    assert extra["reward_status"] == ["ok", "ok"], extra["reward_error"]
    assert scores.tolist() == [1.0, 0.0] and again.tolist() == [1.0, 0.0]
    assert metrics["reward/timeouts"] == 0.0


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
