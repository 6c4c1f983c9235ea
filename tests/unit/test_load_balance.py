"""The pure part of load-balanced calls: chunks of whole groups, chunk seeds, replicas, the config keys."""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch
from verity.config.loader import load_config
from verity.controller.load_balance import (
    LoadBalanceRequest,
    chunk_bounds,
    chunk_seed,
    replica_ranks,
)
from verity.trainer.stages import replica_rows_metrics, training_rows


def covers(bounds: list[tuple[int, int]], rows: int) -> bool:
    return [b for a in bounds for b in range(*a)] == list(range(rows))


def test_chunks_keep_groups_whole_and_cover_every_row_once():
    groups = torch.tensor([5, 5, 5, 7, 7, 7, 9, 9, 9, 1, 1, 1, 4])
    bounds = chunk_bounds(groups, 13, chunk_rows=4)
    assert covers(bounds, 13)
    assert bounds == [(0, 6), (6, 12), (12, 13)]  # 3 rows < 4: a second group joins; the last one alone
    for start, _ in bounds:
        assert start == 0 or groups[start] != groups[start - 1]  # never cut inside a group


@pytest.mark.parametrize("chunk_rows", [1, 3, 6, 100])
def test_chunk_sizes_follow_the_request(chunk_rows):
    groups = torch.arange(8).repeat_interleave(3)  # 8 prompts x n=3
    bounds = chunk_bounds(groups, 24, chunk_rows)
    assert covers(bounds, 24)
    per_chunk = -(-chunk_rows // 3) * 3  # rounded up to whole groups of 3
    assert all(end - start == per_chunk for start, end in bounds[:-1])


def test_without_groups_every_row_is_its_own_group():
    assert chunk_bounds(None, 5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_bounds(None, 0, 2) == []


def test_groups_that_are_not_consecutive_are_refused():
    with pytest.raises(ValueError, match="not consecutive"):
        chunk_bounds(torch.tensor([1, 1, 2, 1]), 4, 2)


def test_default_chunk_size_gives_a_few_chunks_per_replica():
    request = LoadBalanceRequest()
    assert request.rows_per_chunk(64, replicas=2) == 4
    assert request.rows_per_chunk(3, replicas=2) == 1
    assert LoadBalanceRequest(chunk_rows=5).rows_per_chunk(64, 2) == 5
    with pytest.raises(ValueError, match="chunk_rows"):
        LoadBalanceRequest(chunk_rows=0)


def test_chunk_seeds_depend_on_the_seed_and_index_only():
    seeds = {chunk_seed(s, i) for s in range(5) for i in range(50)}
    assert len(seeds) == 250
    assert chunk_seed(3, 7) == chunk_seed(3, 7)


def test_replicas_are_the_ranks_sharing_a_data_parallel_rank():
    # two tensor-parallel replicas of 2 ranks; the first rank of each answers
    assert replica_ranks([0, 0, 1, 1], [True, False, True, False]) == [([0, 1], 0), ([2, 3], 2)]
    assert replica_ranks([0, 1], [True, True]) == [([0], 0), ([1], 1)]
    with pytest.raises(ValueError, match="one collector"):
        replica_ranks([0, 0], [True, True])


def test_training_rows_ask_for_load_balance_as_configured():
    prompts = Batch.from_dict({"input_ids": torch.ones(4, 3, dtype=torch.long)})
    cfg = load_config(["rollout.n=2", "rollout.balance_chunk_rows=4"])
    rows = training_rows(cfg, prompts, step=1)
    assert rows.meta["load_balance"] == LoadBalanceRequest(chunk_rows=4)
    split = training_rows(load_config(["rollout.n=2", "rollout.balance=split"]), prompts, step=1)
    assert "load_balance" not in split.meta


def test_agent_rollouts_split_unless_asked_to_balance_by_load():
    prompts = Batch.from_dict({"input_ids": torch.ones(4, 3, dtype=torch.long)})
    agent = ["rollout.n=2", "rollout.agent.enabled=true", "rollout.agent.tools=[{class_name: calculator}]"]
    assert "load_balance" not in training_rows(load_config(agent), prompts, step=1).meta
    asked = load_config([*agent, "rollout.balance=load"])
    assert training_rows(asked, prompts, step=1).meta["load_balance"] == LoadBalanceRequest()
    assert "load_balance" in training_rows(load_config(["rollout.n=2"]), prompts, step=1).meta
    with pytest.raises(Exception, match="rollout.balance_chunk_rows"):  # idle: the agent loop splits
        load_config([*agent, "rollout.balance_chunk_rows=8"])


def test_chunk_rows_are_idle_without_load_balance():
    with pytest.raises(Exception, match="rollout.balance_chunk_rows"):
        load_config(["rollout.balance=split", "rollout.balance_chunk_rows=8"])
    with pytest.raises(Exception, match="rollout.balance"):
        load_config(["rollout.balance=round_robin"])


def test_replica_rows_become_metrics_and_leave_the_meta():
    batch = Batch.from_dict({"x": torch.zeros(5)}, meta={"rows_per_replica": [3, 2]})
    assert replica_rows_metrics(batch) == {
        "perf/rollout_rows_per_replica_max": 3.0,
        "perf/rollout_rows_per_replica_min": 2.0,
    }
    assert "rows_per_replica" not in batch.meta
    assert replica_rows_metrics(batch) == {}
