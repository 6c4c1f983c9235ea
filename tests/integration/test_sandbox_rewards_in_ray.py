"""Rewards in Ray: RewardManager inside an actor (a hung verifier and hostile code do not stall it),
and the reward-model worker group.

The manager is built on the driver, pickled (without its pool) into the actor, and
starts its own forkserver pool there.
"""

from __future__ import annotations

import json

import pytest
import ray
import torch
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
    one_case = json.dumps({"inputs": ["2\n"], "outputs": ["4"]})  # a looping program costs one case timeout
    rows = [
        {
            "data_source": "codecontests",
            "solution_str": "```python\nprint(2 * int(input()))\n```",
            "ground_truth": tests,
        },
        {
            "data_source": "codecontests",
            "solution_str": "```python\nwhile True: pass\n```",
            "ground_truth": one_case,
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


def test_reward_model_worker_group_splits_rows_over_ranks(cluster, tmp_path):
    from verity.batch import Batch
    from verity.controller import ResourcePool, WorkerGroup
    from verity.workers.reward_model import RewardModelWorker, score_texts
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    # save the classifier once so every rank loads the same score head
    from verity.workers.reward_model import load_reward_model

    classifier = load_reward_model(str(tmp_path))
    classifier.save_pretrained(tmp_path)
    pool = ResourcePool([2], cpus_per_bundle=0.5, name="rm", timeout_s=60)
    group = WorkerGroup(pool, RewardModelWorker, str(tmp_path))
    reports = group.init_model()
    # two ranks and a safetensors folder: sharded, each rank given its shard by rank 0
    assert [r.weights_loaded for r in reports] == ["streamed", "streamed"]
    prompts = [[{"role": "user", "content": f"{i}+1="}] for i in range(3)]
    responses = [str(i + 1) for i in range(3)]
    out = group.compute_rm_score(Batch.from_dict(None, {"raw_prompt": prompts, "response_text": responses}))
    assert out["rm_scores"].shape == (3,)  # padding rows of the split were dropped
    texts = [f"<bos>{i}+1={i + 1}" for i in range(3)]
    expected = score_texts(classifier, tokenizer, texts)
    assert torch.allclose(out["rm_scores"], expected, atol=1e-5)
