"""The sampler-vs-trainer log-prob gap: computed by the actor's compute_log_prob on each rank's rows, reduced
by the old_log_prob stage into a token-weighted mean over every rank, and absent where nothing is recomputed."""

from __future__ import annotations

import torch
from helpers.tiny_models import make_padded_batch, tiny_qwen2
from verity.algorithms.logprob_gap import GAP_ROW_KEYS, gap_metrics, row_gaps
from verity.batch import Batch, validate
from verity.config import load_config
from verity.engines import FSDP2Engine, OptimConfig
from verity.trainer.stages import StepContext, old_log_prob
from verity.workers.actor_rollout import ActorRolloutRefWorker

RECOMPUTE = ["actor.old_logprobs=recompute"]


class TwoRankActor:
    """Stands in for the actor group: each half of the rows goes to its own worker, answers joined in order."""

    def __init__(self, cfg, engine: FSDP2Engine) -> None:
        self.worker = object.__new__(ActorRolloutRefWorker)  # only what compute_log_prob reads
        self.worker.cfg = cfg
        self.worker.actor = engine
        self.requests: list[Batch] = []

    def compute_log_prob(self, batch: Batch) -> Batch:
        self.requests.append(batch)
        first = Batch.from_dict({k: batch[k][:2] for k in batch.tensor_keys()})  # unequal halves
        rest = Batch.from_dict({k: batch[k][2:] for k in batch.tensor_keys()})
        answers = [self.worker.compute_log_prob(part) for part in (first, rest)]
        for answer in answers:
            validate(answer)  # every key that crosses back to the driver is declared
        return Batch.concat(answers)


def rows_with_rollout_logprobs(seed: int = 5) -> tuple[Batch, torch.Tensor]:
    rows = make_padded_batch(rows=7, seed=seed)
    rows.pop("advantages")
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows["responses"].shape, generator=g) * 3
    rollout[rows["response_mask"] == 0] = float("-inf")  # what lies past a response never counts
    return Batch.from_dict({**rows, "rollout_logprobs": rollout}), rollout


def hand_gap(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    total, count, worst = 0.0, 0, 0.0
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[b, t] > 0:
                d = abs(float(old[b, t]) - float(rollout[b, t]))
                total, count, worst = total + d, count + 1, max(worst, d)
    return total / count, worst


def test_the_stage_reports_the_token_mean_over_every_rank_and_drops_the_parts() -> None:
    cfg = load_config(RECOMPUTE)
    engine = FSDP2Engine(tiny_qwen2(seed=3), OptimConfig(lr=1e-2))
    batch, rollout = rows_with_rollout_logprobs()
    actor = TwoRankActor(cfg, engine)
    ctx = StepContext(cfg=cfg, actor=actor, rewards=None, kl_controller=None)
    out = old_log_prob(ctx, batch)
    assert {"rollout_logprobs", "response_mask"} <= set(actor.requests[0].keys())  # sent where the rows are
    assert not set(GAP_ROW_KEYS) & set(out.keys())  # reduced, then dropped
    old, mask = out["old_logprobs"], batch["response_mask"]
    mean, worst = hand_gap(old, rollout, mask)
    assert mean > 0.1  # random log-probs against a model's: far apart
    torch.testing.assert_close(ctx.metrics["actor/rollout_logprob_gap"], mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ctx.metrics["actor/rollout_logprob_gap_max"], worst, rtol=1e-5, atol=1e-6)
    # a mean of each rank's mean would weigh the two ranks' tokens unequally: not what is reported
    halves = [hand_gap(old[s], rollout[s], mask[s])[0] for s in (slice(0, 2), slice(2, None))]
    assert abs(sum(halves) / 2 - ctx.metrics["actor/rollout_logprob_gap"]) > 1e-4


def test_the_gap_is_zero_against_the_trainers_own_logprobs_and_moves_with_a_shift() -> None:
    cfg = load_config(RECOMPUTE)
    engine = FSDP2Engine(tiny_qwen2(seed=3), OptimConfig(lr=1e-2))
    batch, _ = rows_with_rollout_logprobs()
    own, _ = engine.compute_logprobs(batch, cfg.actor.micro_batch_size)
    for shift, expected in ((0.0, 0.0), (0.25, 0.25)):
        ctx = StepContext(cfg=cfg, actor=TwoRankActor(cfg, engine), rewards=None, kl_controller=None)
        batch["rollout_logprobs"] = own - shift
        old_log_prob(ctx, batch)
        assert abs(ctx.metrics["actor/rollout_logprob_gap"] - expected) < 1e-5


def test_absent_when_the_old_logprobs_are_not_recomputed_or_the_rollout_recorded_none() -> None:
    engine = FSDP2Engine(tiny_qwen2(seed=3), OptimConfig(lr=1e-2))
    for overrides in (["actor.old_logprobs=rollout"], []):  # the sampler's own; on-policy: the update's
        cfg = load_config(overrides)
        ctx = StepContext(cfg=cfg, actor=TwoRankActor(cfg, engine), rewards=None, kl_controller=None)
        batch, _ = rows_with_rollout_logprobs()
        old_log_prob(ctx, batch)
        assert not any(name.startswith("actor/rollout_logprob_gap") for name in ctx.metrics)
    cfg = load_config(RECOMPUTE)
    actor = TwoRankActor(cfg, engine)
    ctx = StepContext(cfg=cfg, actor=actor, rewards=None, kl_controller=None)
    batch, _ = rows_with_rollout_logprobs()
    batch.pop("rollout_logprobs")
    out = old_log_prob(ctx, batch)
    assert "old_logprobs" in out and "rollout_logprobs" not in actor.requests[0]
    assert not any(name.startswith("actor/rollout_logprob_gap") for name in ctx.metrics)


def test_row_parts_and_their_reduction() -> None:
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, float("nan")]])
    rollout = torch.tensor([[-1.5, -2.0, -9.0], [-0.25, -1.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    parts = row_gaps(old, rollout, mask)
    assert parts["rollout_logprob_gap_sum"].tolist() == [0.5, 1.25]
    assert parts["rollout_logprob_gap_tokens"].tolist() == [2.0, 2.0]
    assert parts["rollout_logprob_gap_row_max"].tolist() == [0.5, 1.0]
    metrics = gap_metrics(*(parts[k] for k in GAP_ROW_KEYS))
    assert metrics == {"actor/rollout_logprob_gap": 1.75 / 4, "actor/rollout_logprob_gap_max": 1.0}
    assert gap_metrics(torch.zeros(2), torch.zeros(2), torch.zeros(2)) == {}
