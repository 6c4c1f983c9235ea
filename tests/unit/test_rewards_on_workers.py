"""Scoring on the workers (``reward.placement=workers``): the reward stage's group call gives the same
scores, accuracies and failure handling as the driver's reward manager, from per-row scalars."""

from __future__ import annotations

import textwrap

import pytest
import torch
from verity.batch import Batch
from verity.config import load_config
from verity.rewards import RewardFailureError, RewardManager
from verity.rewards.on_workers import (
    FIRST_FAILURE,
    SCORING_KEYS,
    collect_worker_scores,
    score_on_worker,
    worker_reward_manager,
)
from verity.trainer.stages import StepContext, reward
from verity.workers.rollout_side import RowScorer


def generated_rows(texts: list[str], truths: list[str], source: str = "openai/gsm8k") -> Batch:
    lengths = torch.tensor([3, 5, 1, 4, 2, 5][: len(texts)])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    return Batch.from_dict(
        {"responses": torch.ones(len(texts), 5, dtype=torch.long) * 7, "response_mask": mask},
        non_tensors={
            "response_text": texts,
            "data_source": [source] * len(texts),
            "ground_truth": truths,
        },
    )


TEXTS = ["#### 4", "the answer is 5", "#### 12", "####  3", "no idea", "#### 9"]
TRUTHS = ["4", "5", "12", "4", "1", "9"]


class ScoringActor:
    """The actor's group as the reward stage sees it: ``score`` runs a rank's :class:`RowScorer`."""

    def __init__(self, cfg) -> None:
        self.scorer = RowScorer(cfg, tokenizer=None)
        self.requests: list[Batch] = []

    def score(self, request: Batch) -> Batch:
        self.requests.append(request)
        return self.scorer.score(request)


class CannedActor:
    """A group whose ``score`` answers what the ranks answered, concatenated."""

    def __init__(self, answer: Batch) -> None:
        self.answer = answer

    def score(self, request: Batch) -> Batch:
        return self.answer


def driver_ctx(placement: str = "driver", actor: object = None, **reward: object) -> StepContext:
    cfg = load_config([f"reward.placement={placement}"] + [f"reward.{k}={v}" for k, v in reward.items()])
    if placement == "workers" and actor is None:
        actor = ScoringActor(cfg)
    return StepContext(cfg=cfg, actor=actor, rewards=RewardManager(cfg.reward), kl_controller=None)


def test_rows_scored_on_the_workers_give_the_reward_stage_exactly_what_the_driver_computes() -> None:
    on_driver = reward(driver_ctx(), generated_rows(TEXTS, TRUTHS))

    ctx = driver_ctx("workers")
    on_workers = reward(ctx, generated_rows(TEXTS, TRUTHS))

    for key in ("scores", "acc", "token_rewards"):
        assert torch.equal(on_workers[key], on_driver[key]), key
    assert on_driver["acc"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert ctx.metrics["reward/scored_on_workers"] == 1.0
    assert ctx.metrics["reward/timeouts"] == ctx.metrics["reward/errors"] == 0.0
    # one group call, with only what a reward function reads
    (request,) = ctx.actor.requests
    assert set(request.keys()) <= set(SCORING_KEYS) and "responses" in request and "data_source" in request


def write_reward(tmp_path, body: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_without_an_acc_from_every_row_the_accuracy_is_score_above_zero(tmp_path) -> None:
    path = write_reward(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str.startswith("#"):
                return {"score": 0.5, "acc": 0.0}  # the verifier's own judgement
            return -1.0 if "idea" in solution_str else 2.0
        """,
    )
    ctx = driver_ctx("workers", custom_path=path, num_workers=0)
    scored = score_on_worker(worker_reward_manager(ctx.cfg.reward, None), generated_rows(TEXTS, TRUTHS))
    assert torch.isnan(scored["acc"]).tolist() == [False, True, False, False, True, False]
    out = reward(ctx, generated_rows(TEXTS, TRUTHS))
    assert out["acc"].tolist() == (out["scores"] > 0).float().tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]

    on_driver = reward(driver_ctx(custom_path=path, num_workers=0), generated_rows(TEXTS, TRUTHS))
    assert torch.equal(out["acc"], on_driver["acc"]) and torch.equal(out["scores"], on_driver["scores"])


FAILING = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "boom":
        raise ValueError("cannot read " + solution_str)
    return 1.0
"""


def test_the_whole_batch_failure_share_stops_the_run_with_the_first_failure_a_worker_described(
    tmp_path,
) -> None:
    path = write_reward(tmp_path, FAILING)
    cfg = load_config(["reward.placement=workers", f"reward.custom_path={path}", "reward.num_workers=0"])
    manager = worker_reward_manager(cfg.reward, None)
    # one rank's rows fail 2 of 3 (above the rate on its own): it reports, it does not stop
    first = score_on_worker(manager, generated_rows(TEXTS[:3], ["boom", "boom", "1"]))
    assert first["reward_status"].tolist() == [2, 2, 0] and first["scores"].tolist() == [0.0, 0.0, 1.0]
    assert "cannot read #### 4" in first.meta[FIRST_FAILURE] and "ValueError" in first.meta[FIRST_FAILURE]
    second = score_on_worker(manager, generated_rows(TEXTS[3:], ["1", "1", "1"]))
    assert FIRST_FAILURE not in second.meta
    # the whole batch: 2 of 6 failed, within 0.5
    ctx = driver_ctx("workers", CannedActor(Batch.concat([first, second])), max_failure_rate=0.5)
    out = reward(ctx, generated_rows(TEXTS, TRUTHS))
    assert ctx.metrics["reward/errors"] == 2.0 and ctx.metrics["reward/timeouts"] == 0.0
    assert out["scores"].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]

    failing = score_on_worker(manager, generated_rows(TEXTS[:4], ["boom", "boom", "boom", "1"]))
    ctx = driver_ctx("workers", CannedActor(failing), max_failure_rate=0.5)
    with pytest.raises(RewardFailureError, match=r"(?s)3 of 4 samples failed \(3 errors.*cannot read #### 4"):
        reward(ctx, generated_rows(TEXTS[:4], TRUTHS[:4]))


def test_collect_counts_timeouts_and_errors_by_status_code() -> None:
    batch = Batch.from_dict(
        {
            "scores": torch.tensor([1.0, 0.0, 0.0, 1.0]),
            "acc": torch.tensor([1.0, 0.0, 0.0, 1.0]),
            "reward_status": torch.tensor([0, 1, 2, 0], dtype=torch.int8),
        }
    )
    scores, acc, metrics = collect_worker_scores(batch, max_failure_rate=0.5, first_failure=None)
    assert metrics == {"reward/timeouts": 1.0, "reward/errors": 1.0}
    assert acc.tolist() == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(RewardFailureError, match=r"2 of 4 samples failed .*\(not described\)"):
        collect_worker_scores(batch, max_failure_rate=0.25)


def test_a_rank_builds_its_reward_manager_on_the_first_score_call() -> None:
    scorer = RowScorer(load_config(["reward.placement=workers"]), tokenizer=None)
    assert scorer._manager is None  # a run that scores on the driver never starts a pool here
    scored = scorer.score(generated_rows(TEXTS, TRUTHS))
    assert scored["scores"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert set(scored.keys()) == {"scores", "acc", "reward_status"}
    assert scorer._manager is not None and scorer._manager.config.max_failure_rate == 1.0
    scorer.close()


def test_placement_is_checked_before_the_run() -> None:
    from verity.config.errors import ConfigError
    from verity.config.validate import validate_config

    with pytest.raises(ConfigError, match=r"reward.placement must be one of driver\|workers, got 'gpu'"):
        validate_config(load_config(["reward.placement=gpu"]))


def test_a_rank_scores_its_rows_in_host_memory(monkeypatch) -> None:
    moved_to = []
    real_to = Batch.to

    def spy_to(self, device, non_blocking=False):
        moved_to.append(str(device))
        return real_to(self, device, non_blocking)

    monkeypatch.setattr(Batch, "to", spy_to)
    scorer = RowScorer(load_config(["reward.placement=workers"]), tokenizer=None)
    scored = scorer.score(generated_rows(TEXTS, TRUTHS))
    assert moved_to == ["cpu"] and scored["scores"].device.type == "cpu"


def test_the_remax_baseline_is_scored_by_the_same_group_call() -> None:
    from verity.trainer.stages import generate_baseline

    cfg = load_config(["reward.placement=workers", "algorithm.advantage.estimator=remax"])
    generated = []

    class Actor(ScoringActor):
        def generate(self, batch: Batch) -> Batch:
            generated.append(batch)
            return generated_rows(TEXTS, TRUTHS)

    class NoDriverRewards:
        def score(self, batch):
            raise AssertionError("scored on the driver")

    actor = Actor(cfg)
    ctx = StepContext(cfg=cfg, actor=actor, rewards=NoDriverRewards(), kl_controller=None)
    prompts = generate_baseline(ctx, Batch.from_dict({"x": torch.zeros(6)}))
    assert generated[0].meta["sampling"]["do_sample"] is False and len(actor.requests) == 1
    assert prompts["baseline_scores"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_a_scoring_rank_without_the_reward_file_stops_before_any_step(tmp_path) -> None:
    import socket

    here = tmp_path / "reward.py"
    here.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    ok = load_config(["reward.placement=workers", f"reward.custom_path={here}"])
    RowScorer(ok, None)  # the file is here: nothing is imported, nothing raised
    for overrides in (
        [f"reward.custom_path={here}"],
        [f"+reward.overrides.gsm8k='{here}:compute_score'"],
    ):
        here.write_text("def compute_score(*args, **kwargs):\n    return 1.0\n")
        cfg = load_config(["reward.placement=workers", *overrides])  # the driver has the file
        driver = load_config(["reward.placement=driver", *overrides])
        here.unlink()  # a node that does not
        with pytest.raises(
            FileNotFoundError, match=rf"is not a file on node {socket.gethostname()}.*placement=driver"
        ):
            RowScorer(cfg, None)
        RowScorer(driver, None)  # scored on the driver: the driver's check is enough


def test_rows_asked_to_be_scored_without_the_reward_columns_are_refused_with_the_way_out() -> None:
    rows = Batch.from_dict({"responses": torch.ones(2, 3, dtype=torch.long)}, {"data_source": ["a", "b"]})
    with pytest.raises(ValueError, match=r"carry no ground_truth .*reward.placement=driver"):
        score_on_worker(worker_reward_manager(load_config([]).reward, None), rows)
