"""The one RL loop: for each step, run the stages in order, time them, log the metrics.

The loop knows nothing of a particular algorithm: the stages chosen from the
config (:func:`verity.trainer.stages.default_stages`) carry that. It evaluates
held-out accuracy (greedy) before training, every ``trainer.val_every`` steps and
at the end, logs everything to MLflow, and writes ``summary.json``.

A stage may leave no rows (a filter that kept no prompt group): the step then ends
there, without the remaining stages (no update), and logs ``train/step_skipped = 1``
with the metrics the stages reported so far.

Resuming: a run restored from a checkpoint sets ``start_step`` (steps already done)
and ``result`` (their metrics) before :meth:`RLTrainer.fit`. ``on_step_end(step,
result)`` runs after each step (checkpoints, SIGTERM; see ``verity.checkpoint.hooks``)
and ``stage_guard`` puts a time limit on every stage (``verity.trainer.stage_guard``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from verity.batch import Batch
from verity.config.schema import VerityConfig
from verity.controller.transfer_meter import DRIVER_TRANSFERS
from verity.trainer.agent_metrics import merge_validation_counts, validation_agent_metrics
from verity.trainer.metrics import StageTimer, batch_metrics, real_tokens
from verity.trainer.stages import Stage, StepContext


def validation_sampling(cfg: VerityConfig) -> dict[str, Any]:
    """Sampling of the one-response held-out pass (``val/acc``).

    Greedy at ``rollout.val_temperature == 0``, else one sample at it with
    ``rollout.val_top_p`` (``rollout.top_p`` when null); greedy whenever
    ``rollout.val_n > 1`` (the ``k`` samples then go to avg@k and pass@k,
    :mod:`verity.trainer.sampled_validation`).
    """
    temperature = cfg.rollout.val_temperature if cfg.rollout.val_n == 1 else 0.0
    sampled = temperature > 0
    top_p = cfg.rollout.top_p if cfg.rollout.val_top_p is None else cfg.rollout.val_top_p
    return {
        "do_sample": sampled,
        "temperature": temperature if sampled else 0.0,
        "top_p": top_p if sampled else 1.0,
        "top_k": (cfg.rollout.top_k if cfg.rollout.top_k > 0 else -1) if sampled else -1,
        "max_new_tokens": cfg.data.max_response_length,
        "n": 1,
    }


@dataclass
class TrainResult:
    """What a finished run reports (also written to ``summary.json``)."""

    history: list[dict[str, float]] = field(default_factory=list)  # per-step metrics
    validation: list[dict[str, float]] = field(default_factory=list)  # with a "step" key
    wall_seconds: float = 0.0


class RLTrainer:
    """Drives the worker groups through ``trainer.total_steps`` RL steps.

    Args:
        cfg: the validated run config.
        actor: the actor/rollout/reference worker group.
        rewards: a :class:`verity.rewards.RewardManager`.
        train_batches: a loader with ``next_batch()`` giving prompt batches (``input_ids``/``attention_mask``/
            ``position_ids`` ``[B, P]`` left-padded, non-tensors ``data_source``,
            ``ground_truth``), ``data.train_batch_size`` prompts each.
        val_batches: a callable returning an iterable of held-out prompt batches.
        tracker: a :class:`verity.tracking.Tracker` (or ``None``).
        kl_controller: for KL in the reward.
        critic: the critic worker group (``compute_values``, ``update_critic``), or ``None``.
        roles: every role's handle by name (the actor and critic are added from the
            arguments above), for stages that use other roles (``ctx.roles``).
        stages: override the stage list (default: the config's stage plan, plug-in
            planners included, :func:`verity.trainer.stage_plan.build_stage_plan`).
        progress: a callable ``(step, metrics)`` for console progress, or ``None``.
        note: a callable ``(message)`` printing a line between steps (validation), or ``None``.
    """

    def __init__(
        self,
        cfg: VerityConfig,
        *,
        actor: Any,
        rewards: Any,
        train_batches: Any,
        val_batches: Any,
        tracker: Any | None = None,
        kl_controller: Any | None = None,
        critic: Any | None = None,
        roles: dict[str, Any] | None = None,
        stages: list[Stage] | None = None,
        progress: Any | None = None,
        note: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.actor = actor
        self.rewards = rewards
        self.train_batches = train_batches
        self.val_batches = val_batches
        self.tracker = tracker
        self.kl_controller = kl_controller
        self.critic = critic
        self.roles = dict(roles or {})
        if stages is None:
            from verity.trainer.stage_plan import build_stage_plan

            stages = build_stage_plan(cfg).stages
        self.stages = stages
        self.progress = progress
        self.note = note
        self.start_step = 0  # RL steps already done (a resumed run)
        self.result = TrainResult()  # their metrics and evaluations
        self.on_step_end: Any | None = None  # callable (step, result) after each step
        self.stage_guard: Any | None = None  # verity.trainer.stage_guard.StageGuard

    def _guard(self, name: str, step: int) -> contextlib.AbstractContextManager:
        return (
            self.stage_guard.stage(name, step) if self.stage_guard is not None else contextlib.nullcontext()
        )

    # ---------------------------------------------------------------- validation
    def validate(self, step: int) -> dict[str, float]:
        """Accuracy and mean score on the held-out prompts: ``val/acc``, ``val/reward``.

        One response per prompt: greedy, or sampled at ``rollout.val_temperature`` when it is > 0
        and ``rollout.val_n`` is 1. With ``rollout.val_n = k > 1`` also ``k`` samples per prompt:
        ``val/avg_at_k``, ``val/pass_at_k`` (:mod:`verity.trainer.sampled_validation`).
        """
        started = time.perf_counter()
        if self.note is not None:
            self.note(f"validating at step {step}")
        correct = total = 0.0
        score_sum = 0.0
        per_source: dict[str, list[float]] = {}
        lengths = 0.0
        agent_totals: dict[str, float] = {}
        for prompts in self.val_batches():
            prompts.meta["sampling"] = validation_sampling(self.cfg)
            prompts.meta["seed"] = self.cfg.trainer.seed * 1_000_003 + 999_983 + step
            out = self.actor.generate(prompts)
            scores, extra, _ = self.rewards.score(out)
            acc = extra.get("acc")
            accs = [
                float(a) if a is not None else float(s > 0)
                for a, s in zip(acc or [None] * len(scores), scores.tolist(), strict=True)
            ]
            correct += sum(accs)
            score_sum += float(scores.sum())
            total += len(accs)
            lengths += float(out["response_mask"].float().sum())
            merge_validation_counts(agent_totals, out)
            for source, a in zip(out["data_source"], accs, strict=True):
                per_source.setdefault(source, []).append(a)
        if total == 0:
            raise ValueError("validation set is empty: give data.val_files or use the embedded task")
        metrics = {
            "val/acc": correct / total,
            "val/reward": score_sum / total,
            "val/response_length": lengths / total,
            "val/samples": total,
        }
        for source, accs in per_source.items():
            metrics[f"val/{source}/acc"] = sum(accs) / len(accs)
        metrics.update(validation_agent_metrics(agent_totals))
        if self.cfg.rollout.val_n > 1:
            from verity.trainer.sampled_validation import sampled_validation

            metrics.update(sampled_validation(self.cfg, self.actor, self.rewards, self.val_batches, step))
        if self.note is not None:
            seconds = time.perf_counter() - started
            self.note(
                f"validation at step {step}: accuracy {metrics['val/acc']:.3f} on {int(total)} prompts ({seconds:.0f}s)"
            )
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=step)
        return metrics

    # ------------------------------------------------------------------ training
    def step(self, step: int, prompts: Batch) -> dict[str, float]:
        """Run every stage once on one batch of prompts; returns the step's metrics."""
        ctx = StepContext(
            self.cfg,
            self.actor,
            self.rewards,
            self.kl_controller,
            step=step,
            critic=self.critic,
            roles=dict(self.roles),
            loader=self.train_batches,
        )
        timer = StageTimer()
        DRIVER_TRANSFERS.take()  # what validation or start-up moved is not this step's
        batch = prompts
        for stage in self.stages:
            with timer.stage(stage.name), self._guard(stage.name, step):
                batch = stage.run(ctx, batch)
            if len(batch) == 0:
                # a stage (a filter) left no rows: nothing for the remaining stages to score or train on
                ctx.metrics["train/step_skipped"] = 1.0
                break
        metrics = batch_metrics(batch) if len(batch) else {}
        metrics.update(ctx.metrics)
        metrics.update(timer.metrics())
        tokens = float(real_tokens(batch).sum())
        metrics["perf/total_tokens"] = tokens
        metrics["perf/tokens_per_s"] = tokens / max(metrics["timing/step_s"], 1e-9)
        # a stage that generated more than it kept (e.g. dynamic sampling) reports perf/generated_tokens
        generated = metrics.get("perf/generated_tokens", float(batch["response_mask"].sum()))
        metrics["perf/generated_tokens_per_s"] = generated / max(metrics.get("timing/generate_s", 0.0), 1e-9)
        sent, received = DRIVER_TRANSFERS.take()
        metrics["perf/driver_bytes_sent"] = float(sent)
        metrics["perf/driver_bytes_received"] = float(received)
        return metrics

    def fit(self) -> TrainResult:
        """Validate, train ``trainer.total_steps`` steps (validating every ``val_every``), validate."""
        cfg = self.cfg.trainer
        result = self.result
        start = time.perf_counter()
        if cfg.val_before_train and self.start_step == 0:
            with self._guard("validate", 0):
                result.validation.append({"step": 0, **self.validate(0)})
        for step in range(self.start_step + 1, cfg.total_steps + 1):
            prompts = self.train_batches.next_batch()
            metrics = self.step(step, prompts)
            metrics["train/step"] = float(step)
            result.history.append(metrics)
            if self.tracker is not None:
                self.tracker.log_metrics(metrics, step=step)
            if self.progress is not None:
                self.progress(step, metrics)
            last = step == cfg.total_steps
            if (cfg.val_every and step % cfg.val_every == 0) or last:
                with self._guard("validate", step):
                    result.validation.append({"step": step, **self.validate(step)})
            if self.on_step_end is not None:
                self.on_step_end(step, result)
        result.wall_seconds += time.perf_counter() - start
        return result
