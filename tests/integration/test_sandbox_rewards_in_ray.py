"""RewardManager inside a Ray actor: a hung verifier and a hostile code sample do not stall it.

The manager is built on the driver, pickled (without its pool) into the actor, and
starts its own forkserver pool there.
"""

from __future__ import annotations

import json

import pytest
import ray
from verity.controller import init_ray
from verity.rewards import RewardManager

HANG = (
    "import time\n"
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if solution_str == 'hang':\n"
    "        time.sleep(3600)\n"
    "    return float(solution_str == ground_truth)\n"
)


@ray.remote(num_cpus=1)
class RewardActor:
    def __init__(self, manager: RewardManager) -> None:
        self.manager = manager

    def score(self, rows):
        scores, extra, metrics = self.manager.score(rows)
        return scores.tolist(), extra["reward_status"], metrics

    def close(self) -> None:
        self.manager.close()


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2, object_store_memory=100 * 1024**2)
    yield
    ray.shutdown()


def test_rewards_in_an_actor_survive_hangs(cluster, tmp_path):
    path = tmp_path / "hang_reward.py"
    path.write_text(HANG)
    manager = RewardManager({"num_workers": 2, "timeout_s": 1.0, "custom_path": str(path)})
    actor = RewardActor.remote(manager)
    rows = [{"data_source": "d", "solution_str": s, "ground_truth": "a"} for s in ["a", "hang", "b", "a"]]
    scores, status, metrics = ray.get(actor.score.remote(rows), timeout=120)
    assert scores == [1.0, 0.0, 0.0, 1.0]
    assert status == ["ok", "timeout", "ok", "ok"]
    assert metrics["reward/timeouts"] == 1.0
    ray.get(actor.close.remote())


def test_code_rewards_in_an_actor(cluster):
    tests = json.dumps({"inputs": ["2\n", "3\n"], "outputs": ["4", "6"]})
    rows = [
        {
            "data_source": "codecontests",
            "solution_str": "```python\nprint(2 * int(input()))\n```",
            "ground_truth": tests,
        },
        {
            "data_source": "codecontests",
            "solution_str": "```python\nwhile True: pass\n```",
            "ground_truth": tests,
        },
        {
            "data_source": "codecontests",
            "solution_str": "```python\nimport os\nos.fork()\n```",
            "ground_truth": tests,
        },
    ]
    manager = RewardManager({"num_workers": 1, "timeout_s": 20.0})
    actor = RewardActor.remote(manager)
    scores, status, _ = ray.get(actor.score.remote(rows), timeout=120)
    assert scores == [1.0, 0.0, 0.0]
    assert status == ["ok", "ok", "ok"]  # the sandbox contained the hostile programs itself
    ray.get(actor.close.remote())
