"""PRIME's stages and the planner that places them in the one RL loop.

With ``algorithm.advantage.estimator: prime`` the step becomes (bracketed: by config)::

    [prime_oversample] -> generate -> reward -> [prime_filter] -> old_log_prob -> [ref_log_prob]
        -> prm_ref_log_prob -> PRM stages -> prime_advantage -> update_actor

and the PRM stages follow ``prm.update``:

    before:  prm_score -> prm_update -> prm_forward    (rewards from the PRM after it trained: double forward)
    after:   prm_forward -> prm_update                 (rewards from the PRM before it trained: single forward)
    none:    prm_forward                               (a frozen PRM)

- ``prime_oversample`` (``prime.filter.oversample > 1``) draws ``oversample - 1`` more
  prompt batches from the loader (resumably), so the filter has more groups to choose from.
- ``prime_filter`` keeps the prompt groups whose accuracy (mean ``acc`` of their
  samples) lies in ``[accuracy_lower, accuracy_upper]``, at most ``data.train_batch_size``
  of them, first drawn first. When none is kept the rest of the step is skipped (the
  loop logs ``train/step_skipped``).
- ``prm_ref_log_prob``: the PRM's frozen reference log-probs, once per step.
- ``prm_score``/``prm_forward``: process rewards from the PRM. The PRM's accuracy and
  AUC are always measured on scores from BEFORE it trains on the step's rollouts,
  i.e. on responses it has never seen (``prm_score`` exists for that in ``before`` mode).
- ``prm_update``: cross-entropy of the implicit score against ``acc`` (see
  :mod:`verity_recipe_prime.implicit_prm`).
- ``prime_advantage`` replaces ``advantage``: :func:`~verity_recipe_prime.estimator.prime_advantages`.

Metrics: ``prime/outcome_reward_mean`` and ``prime/acc_mean`` (every rollout sampled this
step, before filtering), ``prime/kept_share`` and ``prime/groups_kept``, ``prm/loss``,
``prm/grad_norm``, ``prm/lr``, ``prm/optimizer_steps``, ``prm/auc`` (absent when the kept
rollouts are all right or all wrong), ``prm/acc``, ``prm/score_right_mean`` /
``prm/score_wrong_mean``, ``prime/process_reward_mean`` (per response token) and
``prime/process_score_mean`` (per response).
"""

from __future__ import annotations

from typing import Any

import torch
from verity.algorithms.masked_ops import masked_mean
from verity.batch import Batch
from verity.trainer.stage_plan import StagePlan
from verity.trainer.stages import SEQUENCE_KEYS, Stage, StepContext

from verity_recipe_prime.config import prime_enabled
from verity_recipe_prime.estimator import prime_advantages
from verity_recipe_prime.implicit_prm import auc, classification_accuracy
from verity_recipe_prime.prm_worker import PRM_UPDATE_KEYS

PRM_ROLE = "prm"


def oversample(ctx: StepContext, prompts: Batch) -> Batch:
    """Add ``prime.filter.oversample - 1`` more prompt batches from the loader to this step's prompts."""
    extra = [ctx.loader.next_batch() for _ in range(ctx.cfg.prime.filter.oversample - 1)]
    return Batch.concat([prompts, *extra]) if extra else prompts


def groups_in_range(
    group: torch.Tensor, acc: torch.Tensor, lower: float, upper: float, limit: int
) -> torch.Tensor:
    """``[B]`` bool: rows of the first ``limit`` groups (in order of first appearance) whose
    mean ``acc`` lies in ``[lower, upper]``."""
    ids, inverse = torch.unique(group, return_inverse=True)
    counts = torch.zeros(len(ids), dtype=torch.float64).index_add(
        0, inverse, torch.ones_like(acc, dtype=torch.float64)
    )
    sums = torch.zeros(len(ids), dtype=torch.float64).index_add(0, inverse, acc.to(torch.float64))
    accuracy = sums / counts
    in_range = (accuracy >= lower) & (accuracy <= upper)
    first_row = torch.full((len(ids),), len(group), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(group)), reduce="amin"
    )
    chosen = torch.zeros(len(ids), dtype=torch.bool)
    order = [int(g) for g in torch.argsort(first_row) if bool(in_range[g])]
    chosen[order[:limit]] = True
    return chosen[inverse]


def filter_groups(ctx: StepContext, batch: Batch) -> Batch:
    """Keep the groups whose sample accuracy is in range (see the module docstring)."""
    f = ctx.cfg.prime.filter
    acc = batch["acc"].float()
    ctx.metrics["prime/outcome_reward_mean"] = float(batch["scores"].float().mean())
    ctx.metrics["prime/acc_mean"] = float(acc.mean())
    keep = groups_in_range(
        batch["group"], acc, f.accuracy_lower, f.accuracy_upper, ctx.cfg.data.train_batch_size
    )
    n_groups = len(torch.unique(batch["group"]))
    kept = len(torch.unique(batch["group"][keep]))
    ctx.metrics["prime/kept_share"] = kept / n_groups
    ctx.metrics["prime/groups_kept"] = float(kept)
    return batch if bool(keep.all()) else batch.index(keep)


def prm_ref_log_prob(ctx: StepContext, batch: Batch) -> Batch:
    """``prm_ref_logprobs [B, R]`` from the PRM's frozen reference."""
    return batch.union(ctx.role(PRM_ROLE).compute_ref_log_prob(batch.select(*SEQUENCE_KEYS)))


def _process_rewards(ctx: StepContext, batch: Batch) -> torch.Tensor:
    request = batch.select(*SEQUENCE_KEYS, "response_mask", "prm_ref_logprobs")
    return ctx.role(PRM_ROLE).compute_process_rewards(request)["prm_process_rewards"]


def record_separation(ctx: StepContext, rewards: torch.Tensor, acc: torch.Tensor) -> None:
    """``prm/auc``, ``prm/acc`` and the mean implicit score of right and wrong responses."""
    scores = rewards.sum(-1).double()
    right = acc.float() > 0.5
    area = auc(scores, acc)
    if area is not None:
        ctx.metrics["prm/auc"] = area
    ctx.metrics["prm/acc"] = classification_accuracy(scores, acc)
    if bool(right.any()):
        ctx.metrics["prm/score_right_mean"] = float(scores[right].mean())
    if bool((~right).any()):
        ctx.metrics["prm/score_wrong_mean"] = float(scores[~right].mean())


def prm_score(ctx: StepContext, batch: Batch) -> Batch:
    """Score the step's rollouts with the PRM before it trains on them (its separation metrics only)."""
    record_separation(ctx, _process_rewards(ctx, batch), batch["acc"])
    return batch


def prm_forward(ctx: StepContext, batch: Batch) -> Batch:
    """``prm_process_rewards [B, R]`` from the PRM as it is now (and, unless it already trained on
    this step's rollouts, its separation metrics)."""
    rewards = _process_rewards(ctx, batch)
    if ctx.cfg.prm.update != "before":
        record_separation(ctx, rewards, batch["acc"])
    batch["prm_process_rewards"] = rewards
    return batch


def prm_update(ctx: StepContext, batch: Batch) -> Batch:
    """One PRM update on this step's rollouts, labelled by the verifier (``acc`` in [0, 1])."""
    acc = batch["acc"]
    if bool(((acc < 0) | (acc > 1)).any()):
        raise ValueError(
            f"the PRM's labels (acc) must lie in [0, 1]; got values in [{acc.min()}, {acc.max()}]"
        )
    ctx.metrics.update(ctx.role(PRM_ROLE).update_prm(batch.select(*PRM_UPDATE_KEYS)))
    return batch


def prime_advantage(ctx: StepContext, batch: Batch) -> Batch:
    """``advantages``/``returns`` from the verifier's scores and the PRM's process rewards."""
    p = ctx.cfg.prime
    mask = batch["response_mask"].float()
    rewards = batch["prm_process_rewards"]
    advantages, returns = prime_advantages(
        outcome_scores=batch["scores"].float(),
        process_rewards=rewards,
        response_mask=mask,
        group=batch["group"],
        outcome_weight=p.outcome_weight,
        process_weight=p.process_weight,
        gamma=p.gamma,
        process_reward_norm=p.process_reward_norm,
        whiten=p.whiten,
        whiten_eps=ctx.cfg.algorithm.advantage.whiten_eps,
    )
    batch["advantages"], batch["returns"] = advantages, returns
    ctx.metrics.setdefault("prime/outcome_reward_mean", float(batch["scores"].float().mean()))
    ctx.metrics["prime/process_reward_mean"] = float(masked_mean(rewards, mask))
    ctx.metrics["prime/process_score_mean"] = float(rewards.sum(-1).mean())
    return batch


def plan_prime(cfg: Any, plan: StagePlan) -> None:
    """Place PRIME's stages (module docstring) when the estimator is ``prime``; otherwise change nothing."""
    if not prime_enabled(cfg):
        return
    f = cfg.prime.filter
    if f.oversample > 1:
        plan.insert_before("generate", Stage("prime_oversample", oversample))
    if f.enabled:
        plan.insert_after("reward", Stage("prime_filter", filter_groups))
    prm = [Stage("prm_ref_log_prob", prm_ref_log_prob)]
    if cfg.prm.update == "before":
        prm += [
            Stage("prm_score", prm_score),
            Stage("prm_update", prm_update),
            Stage("prm_forward", prm_forward),
        ]
    elif cfg.prm.update == "after":
        prm += [Stage("prm_forward", prm_forward), Stage("prm_update", prm_update)]
    else:
        prm += [Stage("prm_forward", prm_forward)]
    for stage in prm:
        plan.insert_before("advantage", stage)
    plan.replace("advantage", Stage("prime_advantage", prime_advantage))
