"""The stages of one RL step, each a small function ``stage(ctx, batch) -> batch``.

The one RL loop (:mod:`verity.trainer.loop`) runs a list of :class:`Stage` in
order and times each. The full list is::

    [generate_baseline] -> generate -> [agent_metrics] -> reward -> [reward_model] -> old_log_prob
        -> [ref_log_prob] -> [values] -> advantage -> [update_critic] -> update_actor

(the weight sync to the rollout happens inside ``update_actor``, timed as
``timing/weight_sync_s``). The bracketed stages run only when the config needs
them: ``ref_log_prob`` when a KL term needs the reference; ``values`` and
``update_critic`` when there is a critic (an estimator that needs values, e.g.
``gae`` for PPO, or ``critic.enabled=true``); ``generate_baseline`` when the
estimator needs ``baseline_scores`` (ReMax: the score of a greedy response to each
prompt); ``reward_model`` when ``reward_model.enabled`` (a learned reward model's
score added to the rule reward); ``agent_metrics`` when ``rollout.agent.enabled``
(tool-call and tool-error rates of the multi-turn rollouts,
:mod:`verity.rollout.agent.metrics`). An algorithm that needs another step (a process
reward, dynamic sampling) adds or replaces stages through a stage planner
(:mod:`verity.trainer.stage_plan`); it never copies the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from verity.algorithms.advantages import compute_advantages
from verity.algorithms.kl_control import apply_kl_penalty
from verity.algorithms.logprob_gap import GAP_ROW_KEYS, GAP_SUM_KEY, gap_metrics
from verity.batch import Batch, register_key
from verity.batch.balance import BALANCE_META, BalanceRequest, row_tokens
from verity.config.derived import (
    generate_balance,
    needs_baseline,
    needs_critic,
    needs_reference,
    old_logprobs_source,
    scores_on_workers,
    skips_zero_advantage_rows,
)
from verity.config.schema import VerityConfig
from verity.controller.balanced_call import ROWS_PER_REPLICA_META
from verity.controller.load_balance import LOAD_BALANCE_META, LoadBalanceRequest
from verity.data.vision_inputs import VISION_KEYS
from verity.engines.train_rows import rows_with_advantage
from verity.rewards.manager import response_span, token_rewards_from_scores
from verity.rewards.on_workers import FIRST_FAILURE, collect_worker_scores, scoring_request
from verity.rollout.agent.metrics import agent_batch_metrics
from verity.trainer.role_handles import ActorHandle, CriticHandle, RewardModelHandle


@dataclass
class StepContext:
    """What the stages of one step share.

    Attributes:
        cfg: the run config (plug-in sections included: ``ctx.cfg.dapo``).
        actor: the actor/rollout/reference role (its methods are group calls).
        rewards: the :class:`verity.rewards.RewardManager`.
        kl_controller: the KL-in-reward coefficient controller, or None.
        step: this RL step's number (1-based).
        metrics: what the stages report; the loop logs them with the step's metrics.
        critic: the critic role, when the run has one.
        roles: every role of the run by name (``actor``, ``critic``, ``reward_model``,
            a plug-in's); :meth:`role` looks one up with a clear error.
        loader: the training prompt loader: ``loader.next_batch()`` draws the next
            ``data.train_batch_size`` prompts (a stage that needs more prompts, e.g.
            dynamic sampling, draws them here, so a resumed run draws the same ones).
    """

    cfg: VerityConfig
    actor: ActorHandle
    rewards: Any
    kl_controller: Any | None
    step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    critic: CriticHandle | None = None
    roles: dict[str, Any] = field(default_factory=dict)
    loader: Any | None = None

    def __post_init__(self) -> None:
        for name, handle in (("actor", self.actor), ("critic", self.critic)):
            if handle is not None:
                self.roles.setdefault(name, handle)

    def role(self, name: str) -> Any:
        """The handle of role ``name``; KeyError naming the roles this run has otherwise.

        Its type is the role's own (:mod:`verity.trainer.role_handles`: ``RewardModelHandle``,
        ``AsyncRolloutHandle``, a plug-in's protocol); annotate the variable that receives it.
        """
        if name not in self.roles:
            raise KeyError(f"this run has no role {name!r}; its roles: {sorted(self.roles)}")
        return self.roles[name]


StageFn = Callable[[StepContext, Batch], Batch]


@dataclass(frozen=True)
class Stage:
    """One named step of the RL loop: ``run(ctx, batch) -> batch``."""

    name: str
    run: StageFn


def sampling_for_training(cfg: VerityConfig) -> dict[str, Any]:
    """The rollout's sampling parameters during training (one sample per already-repeated row)."""
    r = cfg.rollout
    return {
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k if r.top_k > 0 else -1,
        "max_new_tokens": cfg.data.max_response_length,
        "do_sample": r.temperature > 0,
        "n": 1,
    }


register_key(
    "baseline_scores",
    ("B",),
    "float",
    "score of a greedy (argmax) response to the sample's prompt (the ReMax baseline)",
)


def generate_baseline(ctx: StepContext, prompts: Batch) -> Batch:
    """ReMax baseline: one greedy response per prompt, scored; adds ``baseline_scores [P]`` to the prompts.

    Decoding is argmax (``do_sample=False``, temperature 0, ``n=1``), so the
    baseline is the score of the policy's most likely response. ``generate`` then
    repeats the key with the prompts, so each sample carries its prompt's baseline.
    """
    greedy = prompts.select(*prompts.keys())
    greedy.meta["sampling"] = {
        "do_sample": False,
        "temperature": 0.0,
        "max_new_tokens": ctx.cfg.data.max_response_length,
        "n": 1,
    }
    out = ctx.actor.generate(with_load_balance(ctx.cfg, greedy))
    replica_rows_metrics(out)  # the training rows' generate records the replicas' rows
    scores = score_rows(ctx, out)[0]
    prompts["baseline_scores"] = scores.float()
    ctx.metrics["reward/baseline_mean"] = float(scores.float().mean())
    return prompts


def training_rows(cfg: VerityConfig, prompts: Batch, step: int) -> Batch:
    """Step ``step``'s rows: each prompt repeated ``rollout.n`` times (interleaved), ``group`` ids, sampling and seed."""
    n = cfg.rollout.n
    rows = prompts.repeat_interleave(n)
    base = step * len(prompts)
    rows["group"] = torch.arange(base, base + len(prompts), dtype=torch.long).repeat_interleave(n)
    rows.meta["sampling"] = sampling_for_training(cfg)
    rows.meta["seed"] = cfg.trainer.seed * 1_000_003 + step
    return with_load_balance(cfg, rows)


def with_load_balance(cfg: VerityConfig, rows: Batch) -> Batch:
    """``rows`` asking the generate call to balance them over the rollout replicas by load
    (``rollout.balance`` resolved by :func:`~verity.config.derived.generate_balance`;
    :mod:`verity.controller.load_balance`), in chunks of whole groups."""
    if generate_balance(cfg) == "load":
        rows.meta[LOAD_BALANCE_META] = LoadBalanceRequest(chunk_rows=cfg.rollout.balance_chunk_rows)
    return rows


def replica_rows_metrics(batch: Batch) -> dict[str, float]:
    """``perf/rollout_rows_per_replica_max`` / ``_min``: rows each rollout replica generated in a
    load-balanced call (taken out of the answer's meta); empty for a call split in equal parts. Under
    ``perf/``: which replica took which chunk depends on timing, not on the seed."""
    rows = batch.meta.pop(ROWS_PER_REPLICA_META, None)
    if not rows:
        return {}
    return {
        "perf/rollout_rows_per_replica_max": float(max(rows)),
        "perf/rollout_rows_per_replica_min": float(min(rows)),
    }


def generate(ctx: StepContext, prompts: Batch) -> Batch:
    """Repeat each prompt ``rollout.n`` times (interleaved) and sample one response per row."""
    out = ctx.actor.generate(training_rows(ctx.cfg, prompts, ctx.step))
    ctx.metrics.update(replica_rows_metrics(out))
    return out


def score_rows(ctx: StepContext, rows: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(scores [B], acc [B], metrics)`` of generated rows by their rule rewards.

    ``reward.placement=workers``: a group call on the actor's workers, each rank scoring its share
    where the rows are (:mod:`verity.rewards.on_workers`); ``driver``: the driver's reward manager.
    ``acc`` is the verifier's where every row has one, else ``scores > 0``; ``metrics`` are
    ``reward/timeouts`` and ``reward/errors``.
    """
    if scores_on_workers(ctx.cfg):
        answer = ctx.actor.score(scoring_request(rows))
        return collect_worker_scores(answer, ctx.cfg.reward.max_failure_rate, answer.meta.get(FIRST_FAILURE))
    scores, extra, metrics = ctx.rewards.score(rows)
    acc = extra.get("acc")
    if acc is not None and all(a is not None for a in acc):
        acc_tensor = torch.tensor([float(a) for a in acc])
    else:
        acc_tensor = (scores > 0).float()
    return scores, acc_tensor, {k: v for k, v in metrics.items() if k in ("reward/timeouts", "reward/errors")}


def reward(ctx: StepContext, batch: Batch) -> Batch:
    """Score responses by ``data_source`` (:func:`score_rows`): ``scores [B]``, ``acc [B]``, ``token_rewards [B, R]``.

    ``reward/scored_on_workers`` (1 or 0) records where this step's rows were scored.
    """
    ctx.metrics["reward/scored_on_workers"] = float(scores_on_workers(ctx.cfg))
    scores, acc, metrics = score_rows(ctx, batch)
    batch["scores"] = scores
    batch["acc"] = acc
    batch["token_rewards"] = token_rewards_from_scores(scores, batch["response_mask"])
    ctx.metrics.update(metrics)
    return batch


SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def _model_keys(batch: Batch, *keys: str) -> Batch:
    """``batch.select(keys)`` plus the per-row image keys when the prompts have images, and the rollout's
    ``routed_experts`` when it recorded them (rollout routing replay), as it goes to workers."""
    extra = [k for k in (*VISION_KEYS, "routed_experts") if k in batch]
    return batch.select(*keys, *extra)


def balanced(request: Batch, on: bool, mini_batch_rows: int = 0, costs: torch.Tensor | None = None) -> Batch:
    """``request`` asking its group call for token-balanced ranks when ``on`` (``<role>.balance_tokens``).

    The dispatch reorders the rows so that each data-parallel rank gets about the same tokens, each
    row kept in its mini-batch of ``mini_batch_rows`` rows (0: no mini-batches), and puts the answer
    back in order (:mod:`verity.batch.balance`). ``costs``: ``[B]`` per-row cost; default its tokens.
    """
    if on:
        request.meta[BALANCE_META] = BalanceRequest(mini_batch_rows, costs)
    return request


def update_costs(cfg: VerityConfig, batch: Batch) -> torch.Tensor | None:
    """``[B]`` tokens each row runs through the actor's update: its tokens, 0 for a row the update skips
    (zero advantage, :func:`verity.config.derived.skips_zero_advantage_rows`); None when unknown."""
    tokens = row_tokens(batch)
    if tokens is None or not skips_zero_advantage_rows(cfg) or "advantages" not in batch:
        return tokens
    return tokens * rows_with_advantage(batch["advantages"], batch["response_mask"])


def old_log_prob(ctx: StepContext, batch: Batch) -> Batch:
    """The behaviour log-probs ``old_logprobs [B, R]`` of the PPO ratio (``actor.old_logprobs``).

    ``recompute``: the actor's forward before this step's update (also ``entropy``), and, when the
    rollout recorded ``rollout_logprobs``, the sampler-vs-trainer gap ``actor/rollout_logprob_gap``
    and ``actor/rollout_logprob_gap_max`` (:mod:`verity.algorithms.logprob_gap`), measured on the
    workers where those rows are;
    ``rollout``: the sampler's ``rollout_logprobs``; ``policy`` (on-policy runs): nothing
    here, the update uses its own forward's log-probs, detached (see
    :func:`verity.config.derived.old_logprobs_source`).
    """
    source = old_logprobs_source(ctx.cfg)
    if source == "rollout":
        if "rollout_logprobs" not in batch:
            raise RuntimeError("actor.old_logprobs=rollout: the rollout returned no rollout_logprobs")
        batch["old_logprobs"] = batch["rollout_logprobs"].float()
        return batch
    if source == "policy":
        return batch
    gap_keys = ("rollout_logprobs", "response_mask") if "rollout_logprobs" in batch else ()
    request = balanced(_model_keys(batch, *SEQUENCE_KEYS, *gap_keys), ctx.cfg.actor.balance_tokens)
    answer = ctx.actor.compute_log_prob(request)
    if GAP_SUM_KEY in answer:  # reduced here over every rank's rows, then dropped
        parts = [answer.pop(key) for key in GAP_ROW_KEYS]
        ctx.metrics.update(gap_metrics(*parts))
    return batch.union(answer)


def ref_log_prob(ctx: StepContext, batch: Batch) -> Batch:
    """Log-probs under the frozen reference policy (for the KL terms); balanced as the actor's."""
    request = balanced(_model_keys(batch, *SEQUENCE_KEYS), ctx.cfg.actor.balance_tokens)
    return batch.union(ctx.actor.compute_ref_log_prob(request))


def values(ctx: StepContext, batch: Batch) -> Batch:
    """Critic values of the response tokens before this step's update: ``values [B, R]``."""
    if ctx.critic is None:
        raise RuntimeError("the values stage needs a critic worker group (critic.enabled or a gae estimator)")
    request = balanced(_model_keys(batch, *SEQUENCE_KEYS), ctx.cfg.critic.balance_tokens)
    return batch.union(ctx.critic.compute_values(request))


def advantage(ctx: StepContext, batch: Batch) -> Batch:
    """Optional KL-in-reward, then the configured advantage estimator."""
    cfg = ctx.cfg
    kl = cfg.algorithm.kl
    token_rewards = batch["token_rewards"]
    if kl.use_kl_in_reward:
        assert ctx.kl_controller is not None
        token_rewards, kl_metrics = apply_kl_penalty(
            token_rewards,
            batch["old_logprobs"],
            batch["ref_logprobs"],
            batch["response_mask"],
            ctx.kl_controller.value,
            kl.kl_in_reward_kind,
            clamp=kl.kl_clamp,
        )
        ctx.kl_controller.update(kl_metrics["kl"], n_steps=len(batch))
        ctx.metrics.update(
            {"actor/reward_kl": kl_metrics["kl"], "actor/reward_kl_coef": kl_metrics["kl_coef"]}
        )
        batch["token_rewards"] = token_rewards
    adv_cfg = cfg.algorithm.advantage
    advantages, returns = compute_advantages(
        adv_cfg.estimator,
        token_rewards=token_rewards,
        response_mask=batch["response_mask"].float(),
        group=batch["group"],
        values=batch["values"] if "values" in batch else None,  # noqa: SIM401 (Batch has no .get)
        config=adv_cfg,
        baseline_scores=batch["baseline_scores"] if "baseline_scores" in batch else None,  # noqa: SIM401
    )
    batch["advantages"] = advantages
    batch["returns"] = returns
    return batch


def update_critic(ctx: StepContext, batch: Batch) -> Batch:
    """Value-loss update of the critic towards the ``returns`` (old values: ``values``)."""
    if ctx.critic is None:
        raise RuntimeError("the update_critic stage needs a critic worker group")
    keys = (*SEQUENCE_KEYS, "response_mask", "values", "returns")
    c = ctx.cfg.critic
    request = balanced(_model_keys(batch, *keys), c.balance_tokens, c.ppo_mini_batch_size * ctx.cfg.rollout.n)
    ctx.metrics.update(ctx.critic.update_critic(request))
    return batch


def update_actor(ctx: StepContext, batch: Batch) -> Batch:
    """PPO update of the actor on the whole batch, then the weight sync to the rollout.

    Skipped during the critic's warm-up (the first ``critic.warmup_steps`` steps when
    there is a critic), so the policy waits for useful values.
    """
    if needs_critic(ctx.cfg) and ctx.step <= ctx.cfg.critic.warmup_steps:
        ctx.metrics["actor/optimizer_steps"] = 0.0
        return batch
    wanted = (*SEQUENCE_KEYS, "response_mask", "old_logprobs", "advantages", "ref_logprobs")
    keys = [k for k in wanted if k in batch]
    if ctx.cfg.actor.off_policy.is_cap > 0:
        if "rollout_logprobs" not in batch:
            raise RuntimeError(
                "actor.off_policy.is_cap > 0: the rollout returned no rollout_logprobs for the importance weights"
            )
        keys.append("rollout_logprobs")
    a = ctx.cfg.actor
    mini_batch_rows = a.ppo_mini_batch_size * ctx.cfg.rollout.n
    costs = update_costs(ctx.cfg, batch) if a.balance_tokens else None
    request = balanced(_model_keys(batch, *keys), a.balance_tokens, mini_batch_rows, costs)
    ctx.metrics.update(ctx.actor.update_actor(request))
    return batch


def agent_metrics(ctx: StepContext, batch: Batch) -> Batch:
    """Tool-call and tool-error rates of multi-turn rollouts (:mod:`verity.rollout.agent.metrics`)."""
    ctx.metrics.update(agent_batch_metrics(batch))
    return batch


def reward_model_score(ctx: StepContext, batch: Batch) -> Batch:
    """Add the learned reward model's score: ``scores += reward_model.weight x rm_scores [B]``.

    The reward model re-renders each sample from its chat messages (``raw_prompt``) and the
    decoded response with its own tokenizer. ``acc`` stays the verifier's judgement.
    """
    from verity.workers.reward_model import mix_scores

    tokenizer = ctx.rewards.tokenizer
    if tokenizer is None:
        raise RuntimeError(
            "the reward_model stage decodes responses with the policy tokenizer; the reward manager has none"
        )
    mask = response_span(batch).bool()  # the whole response, tool answers of multi-turn rollouts included
    texts = tokenizer.batch_decode(
        [row[m].tolist() for row, m in zip(batch["responses"], mask, strict=True)], skip_special_tokens=True
    )
    request = Batch.from_dict(non_tensors={"response_text": texts, "raw_prompt": list(batch["raw_prompt"])})
    reward_model: RewardModelHandle = ctx.role("reward_model")
    rm_scores = reward_model.compute_rm_score(request)["rm_scores"]
    batch["rm_scores"] = rm_scores
    batch["scores"] = mix_scores(batch["scores"], rm_scores, ctx.cfg.reward_model.weight)
    batch["token_rewards"] = token_rewards_from_scores(batch["scores"], batch["response_mask"])
    ctx.metrics["reward/rm_score_mean"] = float(rm_scores.float().mean())
    return batch


def default_stages(cfg: VerityConfig) -> list[Stage]:
    """The built-in stage list for the configured algorithm (see the module docstring).

    Plug-ins edit it through stage planners (:mod:`verity.trainer.stage_plan`).
    """
    stages = [Stage("generate_baseline", generate_baseline)] if needs_baseline(cfg) else []
    stages += [Stage("generate", generate)]
    if cfg.rollout.agent.enabled:
        stages.append(Stage("agent_metrics", agent_metrics))
    stages.append(Stage("reward", reward))
    if cfg.reward_model.enabled:
        stages.append(Stage("reward_model", reward_model_score))
    stages.append(Stage("old_log_prob", old_log_prob))
    if needs_reference(cfg):
        stages.append(Stage("ref_log_prob", ref_log_prob))
    critic = needs_critic(cfg)
    if critic:
        stages.append(Stage("values", values))
    stages.append(Stage("advantage", advantage))
    if critic:
        stages.append(Stage("update_critic", update_critic))
    stages.append(Stage("update_actor", update_actor))
    return stages
