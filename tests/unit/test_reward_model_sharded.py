"""The reward model sharded over several ranks (gloo): whole-model scores, 1/W of the weights, uneven rows.

Each spawned rank is a :class:`~verity.workers.reward_model.RewardModelWorker` given its
place by ``RANK``/``WORLD_SIZE`` as a worker group gives it, scoring its own rows (some
ranks more micro-batches than others, one rank none); the test compares every score with
the whole model's in one process.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
from helpers.spawn import spawn_and_load
from helpers.tiny_models import save_char_qwen2

MICRO = 2  # rows per forward: the row counts below give the ranks different micro-batch counts

# the conversations, and which rows each rank scores for each world size (rank 1 of 3 scores none)
PROMPTS = [[{"role": "user", "content": f"{i} + {2 * i} = ?" + " pad" * (i % 3)}] for i in range(7)]
RESPONSES = [f"the sum is {3 * i}" + "!" * i for i in range(7)]
SPLITS = {2: [[0, 1, 2, 3, 4], [5, 6]], 3: [[0, 1, 2, 3, 4], [], [5, 6]]}


def _checkpoints(folder) -> tuple[str, str]:
    """(a reward model folder with its score head, a causal-LM folder without one), both safetensors."""
    from verity.workers.reward_model import load_reward_model

    lm = os.path.join(folder, "lm")
    _, tokenizer = save_char_qwen2(lm, seed=5, hidden=64, layers=3, initializer_range=0.2)
    torch.manual_seed(11)
    classifier = load_reward_model(lm)  # the backbone plus a head drawn here, saved once
    rm = os.path.join(folder, "rm")
    classifier.save_pretrained(rm)
    tokenizer.save_pretrained(rm)
    return rm, lm


def _local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from verity.batch import Batch
    from verity.workers.reward_model import RewardModelWorker

    with open(os.path.join(out_dir, "world")) as f:
        world = int(f.read())
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0"
    )
    # three ranks: a group joined already (as colocated roles do); a short timeout turns a hang into an error
    if world > 2:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    out: dict = {}
    worker = RewardModelWorker(os.path.join(out_dir, "rm"), micro_batch_size=MICRO, device="cpu")
    report = worker.init_model()
    rows = SPLITS[world][rank]
    batch = Batch.from_dict(
        None,
        {"raw_prompt": [PROMPTS[i] for i in rows], "response_text": [RESPONSES[i] for i in rows]},
        batch_size=len(rows),
    )
    out["scores"] = worker.compute_rm_score(batch)["rm_scores"]
    out["again"] = worker.compute_rm_score(batch)["rm_scores"]  # the same passes a second time
    model = worker.model
    backbone = getattr(model, model.base_model_prefix)
    out["report"] = (report.n_params, report.weights_loaded, report.ran("reward_model"))
    out["local_numel"] = _local_numel(model)
    out["head_numel"] = model.score.weight.numel()
    # after the passes every backbone weight is a shard again (the root's embedding included)
    out["resharded"] = all(isinstance(p, DTensor) for p in backbone.parameters())
    out["sharded"] = worker.sharded
    if world == 2:  # a causal-LM folder: a fresh head, the same in every rank
        fresh = RewardModelWorker(os.path.join(out_dir, "lm"), micro_batch_size=MICRO, device="cpu")
        fresh.init_model()
        out["fresh_head"] = fresh.model.score.weight.detach().clone()
        same = Batch.from_dict(None, {"raw_prompt": PROMPTS[:3], "response_text": RESPONSES[:3]})
        out["fresh_scores"] = fresh.compute_rm_score(same)["rm_scores"]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_reward_model_scores_as_the_whole_model(tmp_path, world):
    from verity.batch import Batch
    from verity.workers.reward_model import RewardModelWorker, load_reward_model

    rm, lm = _checkpoints(tmp_path)
    (tmp_path / "world").write_text(str(world))
    ranks = spawn_and_load(_rank_worker, world, str(tmp_path))

    whole = RewardModelWorker(rm, micro_batch_size=MICRO)
    whole_report = whole.init_model()
    assert not whole.sharded and whole_report.weights_loaded == "whole"

    expected = whole.compute_rm_score(
        Batch.from_dict(None, {"raw_prompt": PROMPTS, "response_text": RESPONSES})
    )["rm_scores"]
    total = sum(p.numel() for p in load_reward_model(rm).parameters())
    got = torch.zeros(len(PROMPTS))
    for rank, out in enumerate(ranks):
        rows = SPLITS[world][rank]
        assert out["sharded"] and out["resharded"]
        assert out["scores"].shape == (len(rows),) and out["scores"].dtype == torch.float32
        assert torch.equal(out["scores"], out["again"])
        got[rows] = out["scores"]
        n_params, loaded, ran = out["report"]
        assert n_params == total and loaded == "streamed"
        assert ran == {"reward_model_weights_loaded": "streamed"}
        # about 1/W of the weights: the backbone's dim-0 chunks plus the whole [1, hidden] head
        share = (total - out["head_numel"]) / world + out["head_numel"]
        assert abs(out["local_numel"] - share) < 0.05 * share, (rank, out["local_numel"], share, total)
    assert sum(out["local_numel"] for out in ranks) == total + (world - 1) * ranks[0]["head_numel"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    if world == 2:
        assert torch.count_nonzero(ranks[0]["fresh_head"]) > 0
        assert torch.equal(ranks[0]["fresh_head"], ranks[1]["fresh_head"])
        torch.testing.assert_close(ranks[0]["fresh_scores"], ranks[1]["fresh_scores"], rtol=0, atol=1e-6)
        assert ranks[0]["fresh_scores"].std() > 0  # the head is drawn, not zero


def test_model_source_reads_the_reward_head_when_the_checkpoint_has_one(tmp_path):
    from verity.engines.model_source import ModelSource

    rm, lm = _checkpoints(tmp_path)
    assert ModelSource(rm, "reward_model").fresh_parameters == ()
    assert ModelSource(lm, "reward_model").fresh_parameters == ("score.",)
    empty = ModelSource(rm, "reward_model").build_empty()
    assert type(empty).__name__ == "Qwen2ForSequenceClassification"
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert tuple(empty.score.weight.shape) == (1, 64)
