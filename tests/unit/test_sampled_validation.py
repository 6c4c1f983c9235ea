"""A run's sampled held-out evaluation: k responses per prompt give avg@k and pass@k beside the greedy val/acc."""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch
from verity.config import ConfigError, load_config
from verity.evaluation.validation import run_validation
from verity.launch.outputs import sampled_before_after
from verity.trainer.loop import RLTrainer, TrainResult

R = 6
# correctness of the k = 4 samples of each held-out prompt (by uid), and the source of the prompt
SAMPLED = {"0": [1, 1, 0, 0], "1": [0, 0, 0, 0], "2": [1, 1, 1, 1]}
SOURCES = {"0": "a", "1": "a", "2": "b"}
GREEDY = {"0": 1, "1": 0, "2": 0}


def prompts() -> Batch:
    uids = ["0", "1", "2"]
    return Batch.from_dict(
        {
            "input_ids": torch.ones(3, 2, dtype=torch.long),
            "attention_mask": torch.ones(3, 2, dtype=torch.long),
        },
        {"uid": uids, "data_source": [SOURCES[u] for u in uids]},
    )


class FakeActor:
    """Records each generate call's sampling; the response of row j is ``j % R + 1`` tokens long."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def generate(self, rows: Batch) -> Batch:
        self.calls.append(
            {"sampling": dict(rows.meta["sampling"]), "seed": rows.meta["seed"], "rows": len(rows)}
        )
        lengths = torch.tensor([j % R + 1 for j in range(len(rows))])
        mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
        out = rows.select(*rows.keys())
        out["response_mask"] = mask
        out["sample"] = list(range(len(rows)))
        return out


class FakeRewards:
    """Scores a row from the tables above: the greedy table for greedy calls, else the sampled one."""

    def score(self, out: Batch):
        greedy = not out.meta["sampling"]["do_sample"]
        acc = []
        seen: dict[str, int] = {}
        for uid in out["uid"]:
            i = seen.get(uid, 0)
            seen[uid] = i + 1
            acc.append(float(GREEDY[uid] if greedy else SAMPLED[uid][i]))
        scores = torch.tensor([1.0 if a else -1.0 for a in acc])  # DAPO-style +1 / -1
        return scores, {"acc": acc}, {}


def config(*extra: str):
    return load_config(
        [
            "rollout.val_n=4",
            "rollout.val_temperature=1.0",
            "rollout.val_top_p=0.7",
            "data.max_response_length=6",
            *extra,
        ]
    )


def test_avg_and_pass_at_k_match_hand_computed_values_per_source_and_overall():
    actor = FakeActor()
    metrics = run_validation(config(), actor, FakeRewards(), lambda: iter([prompts()]), step=3)
    assert metrics["val/k"] == 4.0
    assert metrics["val/avg_at_k"] == pytest.approx((2 + 0 + 4) / 12)
    assert metrics["val/pass_at_k"] == pytest.approx(2 / 3)
    assert metrics["val/a/avg_at_k"] == pytest.approx(2 / 8) and metrics["val/a/pass_at_k"] == 0.5
    assert metrics["val/b/avg_at_k"] == 1.0 and metrics["val/b/pass_at_k"] == 1.0
    lengths = [j % R + 1 for j in range(12)]
    assert metrics["val/sampled_response_length"] == pytest.approx(sum(lengths) / 12)
    assert metrics["val/sampled_clip_ratio"] == pytest.approx(sum(n >= 6 for n in lengths) / 12)
    _, call = actor.calls  # the greedy pass, then the sampled one
    assert call["rows"] == 12  # every prompt repeated k times
    assert call["sampling"]["do_sample"] and call["sampling"]["temperature"] == 1.0
    assert call["sampling"]["top_p"] == 0.7 and call["sampling"]["n"] == 1


def test_validate_keeps_val_acc_greedy_and_adds_the_sampled_metrics():
    actor = FakeActor()
    trainer = RLTrainer(
        config(),
        [],
        roles={"actor": actor},
        rewards=FakeRewards(),
        train_batches=None,
        val_batches=lambda: iter([prompts()]),
    )
    metrics = trainer.validate(0)
    assert metrics["val/acc"] == pytest.approx(1 / 3)  # the greedy table, not the samples
    assert metrics["val/avg_at_k"] == pytest.approx(0.5)
    greedy, sampled = actor.calls
    assert not greedy["sampling"]["do_sample"] and greedy["rows"] == 3
    assert sampled["sampling"]["do_sample"] and sampled["seed"] != greedy["seed"]
    seed = trainer.cfg.trainer.seed * 1_000_003  # the streams every run so far has drawn from
    assert (greedy["seed"], sampled["seed"]) == (seed + 999_983, seed + 777_767)


def test_without_val_n_there_is_one_pass_and_no_sampled_metric():
    actor = FakeActor()
    cfg = load_config(["data.max_response_length=6"])
    trainer = RLTrainer(
        cfg, [], roles={"actor": actor}, rewards=FakeRewards(), train_batches=None, val_batches=lambda: iter([prompts()])
    )
    metrics = trainer.validate(0)
    assert len(actor.calls) == 1 and "val/avg_at_k" not in metrics


def test_summary_fields_before_and_after():
    result = TrainResult(
        validation=[
            {"step": 0, "val/acc": 0.2, "val/avg_at_k": 0.3, "val/pass_at_k": 0.6, "val/k": 8.0},
            {"step": 5, "val/acc": 0.4, "val/avg_at_k": 0.5, "val/pass_at_k": 0.7, "val/k": 8.0},
        ]
    )
    assert sampled_before_after(result) == {
        "val_k": 8.0,
        "avg_at_k_before": 0.3,
        "avg_at_k_after": 0.5,
        "pass_at_k_before": 0.6,
        "pass_at_k_after": 0.7,
    }
    assert sampled_before_after(TrainResult(validation=[{"step": 0, "val/acc": 0.2}])) == {}


def test_val_n_needs_a_sampling_temperature_and_a_valid_top_p():
    with pytest.raises(ConfigError, match="rollout.val_n = 4 samples per held-out prompt need sampling"):
        load_config(["rollout.val_n=4"])
    with pytest.raises(ConfigError, match="rollout.val_n must be >= 1"):
        load_config(["rollout.val_n=0"])
    with pytest.raises(ConfigError, match="rollout.val_top_p must be in"):
        load_config(["rollout.val_n=2", "rollout.val_temperature=1.0", "rollout.val_top_p=0"])
